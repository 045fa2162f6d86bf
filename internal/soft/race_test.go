//go:build race

package soft

// raceEnabled: the test binary runs under the race detector, which makes
// everything slower (TestXprocNoAllocs leaves out what moves hundreds of
// MiB: the provider's copies are word loops then, see dma_race.go).
const raceEnabled = true
