// Package bells keeps the books of doorbells on demand, for the waits of
// package collective and cluster.
//
// A doorbell (an RDMA write with immediate data, channel.Options.Doorbells)
// wakes a rank that sleeps in its completion channel, but costs the rank
// a receive, its completion and its repost even when it spins and would
// have seen the write anyway. With doorbells on demand, writes are plain
// and a rank rings a peer only when the peer said it sleeps. Each rank
// has a sleep word at each peer, odd while it sleeps:
//
//   - A rank about to sleep writes NextSleep (odd) into its sleep word at
//     every peer its wait depends on (Telling, Told), waits until these
//     writes completed (they are placed at the peers), then looks at what
//     it waits for once more before it sleeps. When the wait ends it
//     writes NextAwake (even) to the peers told (Awake).
//   - A rank that wrote to a peer without a doorbell (Wrote) reads the
//     peer's sleep word as it spins, before it sleeps and when its call
//     ends, and rings when Owes says so: the word is odd and either new
//     or older than some of its writes (a queue pair places writes in
//     order, so the doorbell arrives after every write posted before
//     it); then Rang.
//
// If the sleeper's last look missed a write, the write was placed after
// the announcement was, so the writer, reading after its write was
// placed, finds the announcement, as long as it still looks: a write
// placed after its writer's call ended and after the sleeper's whole
// spin is found at the sleeper's alarm instead.
//
// A Book is not safe for concurrent use: its owner's calls are serialised.
package bells

// Book is one rank's books of doorbells on demand with n peers (world or
// communicator ranks, 0 to n-1).
type Book struct {
	epoch    uint64   // the last sleep number written: odd asleep, even awake
	belled   []uint64 // per peer: the last of its sleep numbers rung for
	bellSeq  []uint64 // per peer: quietSeq when it was last rung
	quietSeq []uint64 // per peer: writes without a doorbell
	wrote    []bool   // membership of wroteTo
	wroteTo  []int    // peers written without a doorbell since Forget
	asleep   []bool   // membership of asleepTo
	asleepTo []int    // peers told of a sleep since Awake
}

// New returns the books of a rank with n peers.
func New(n int) *Book {
	return &Book{belled: make([]uint64, n), bellSeq: make([]uint64, n), quietSeq: make([]uint64, n),
		wrote: make([]bool, n), asleep: make([]bool, n)}
}

// Wrote records a write to p without a doorbell.
func (b *Book) Wrote(p int) {
	b.quietSeq[p]++
	if !b.wrote[p] {
		b.wrote[p] = true
		b.wroteTo = append(b.wroteTo, p)
	}
}

// WroteTo returns the peers written to without a doorbell since Forget.
func (b *Book) WroteTo() []int { return b.wroteTo }

// Forget forgets which peers were written to (a call ends); their counts
// stay.
func (b *Book) Forget() {
	for _, p := range b.wroteTo {
		b.wrote[p] = false
	}
	b.wroteTo = b.wroteTo[:0]
}

// Owes reports whether p, whose sleep word reads word, sleeps and may
// have missed a write of this rank: the word is odd, and this rank has
// not rung for that sleep, or wrote to p since it last rang.
func (b *Book) Owes(p int, word uint64) bool {
	return word&1 == 1 && (word > b.belled[p] || b.quietSeq[p] > b.bellSeq[p])
}

// Rang records a doorbell posted to p for its sleep word's value word.
func (b *Book) Rang(p int, word uint64) { b.belled[p], b.bellSeq[p] = word, b.quietSeq[p] }

// NextSleep returns the number of a new sleep (odd), to write to the peers
// told of it.
func (b *Book) NextSleep() uint64 {
	b.epoch = (b.epoch + 1) | 1
	return b.epoch
}

// Sleeps returns how many sleeps were numbered (NextSleep).
func (b *Book) Sleeps() uint64 { return (b.epoch + 1) / 2 }

// Telling reports whether p was told of a sleep since Awake.
func (b *Book) Telling(p int) bool { return b.asleep[p] }

// Told records that p was told of the sleep.
func (b *Book) Told(p int) {
	if !b.asleep[p] {
		b.asleep[p] = true
		b.asleepTo = append(b.asleepTo, p)
	}
}

// Awake returns the number that says the rank is awake (even) and the
// peers to write it to (nil if none was told of a sleep), and forgets
// them. The slice is valid until the next Told.
func (b *Book) Awake() (uint64, []int) {
	if len(b.asleepTo) == 0 {
		return 0, nil
	}
	b.epoch = (b.epoch | 1) + 1
	to := b.asleepTo
	for _, p := range to {
		b.asleep[p] = false
	}
	b.asleepTo = b.asleepTo[:0]
	return b.epoch, to
}
