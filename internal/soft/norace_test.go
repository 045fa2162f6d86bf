//go:build !race

package soft

// raceEnabled: see race_test.go.
const raceEnabled = false
