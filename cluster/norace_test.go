//go:build !race

package cluster

// raceEnabled: see race_test.go.
const raceEnabled = false
