//go:build race

package soft

// raceEnabled: the test binary runs under the race detector, whose runtime
// allocates for the synchronisation it records (TestXprocNoAllocs counts
// nothing then).
const raceEnabled = true
