//go:build race

package cluster

// raceEnabled: the test binary runs under the race detector, whose
// runtime keeps state for every goroutine and every synchronised address
// a program ever had (TestExchangeStrangerMemory measured about 20 MiB
// for a thousand connections, and 38 MiB for four thousand, where the
// same code without the detector stays under 6 MiB).
const raceEnabled = true
