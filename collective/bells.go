package collective

import (
	"errors"
	"sync/atomic"

	"github.com/goverbs/verbs"
	"github.com/goverbs/verbs/channel"
)

// Doorbells on demand (internal/bells has the protocol and its books).
// A doorbell costs a sleeping peer nothing it would not pay anyway, but a
// spinning one a receive, its completion and its repost: on soft0 shared
// memory a sixth of a 2-rank barrier. Where waits spin before they sleep
// (spinwait.Policy.Spin), flags, acknowledgements and small messages are
// plain writes (c.onDemand), and a rank rings a peer only when the peer
// said it sleeps, in its sleep word at this rank (sleepOff). The
// announcements and the awake words ring no doorbell: a peer that does
// not poll (busy outside the calls) may have used up its doorbell
// receives, and a write with immediate data would wait for it. A rank
// looks at the sleep words of the peers it wrote to as its waits spin,
// before it sleeps, and when its call ends; a write placed later than
// that and after the sleeper's whole spin (spinwait.MaxSpin) is found by
// the sleeper's alarm instead (spinwait.Policy.Every). Waits that do not
// spin (more ranks than spinwait.MaxYieldRanks per processor) ring on
// every write.

// sleepOff is the offset of a peer's sleep word in its flags at a rank.
const sleepOff = 64

// owesBell reads p's sleep word and reports whether p is owed a bell
// (bells.Book.Owes).
func (c *Comm) owesBell(p int) (uint64, bool) {
	v := atomic.LoadUint64(word(c.rx, p*peerFlagBytes+sleepOff))
	return v, c.book.Owes(p, v)
}

// ringSleepers rings the peers written to without a doorbell in this call
// that are owed it (owesBell). A full send queue leaves the bell for the
// next look.
func (c *Comm) ringSleepers() error {
	for _, p := range c.book.WroteTo() {
		v, owed := c.owesBell(p)
		if !owed {
			continue
		}
		if err := c.bell(p); err != nil {
			if errors.Is(err, verbs.ErrQueueFull) {
				continue
			}
			return c.stepErr(p, err)
		}
		c.book.Rang(p, v)
	}
	return nil
}

// bell posts a doorbell to p: a write with immediate data of the probe
// word, which nobody reads.
func (c *Comm) bell(p int) error {
	src, err := c.tx.SGE(c.probeSrc, 8)
	if err != nil {
		return err
	}
	ch := c.mc.Peer(c.ranks[p])
	err = c.postTwice(func() error { return ch.PostWriteImmUnsignaled(c.remote[p].At(uint64(c.size*peerFlagBytes)), 0, src) })
	if err == nil {
		c.sleepWrites++
	}
	return err
}

// endQuiet rings, once more, the peers of the call that ends that sleep,
// and forgets which peers it wrote to in the call. Best effort: a peer it
// cannot ring wakes at its alarm.
func (c *Comm) endQuiet() {
	if len(c.book.WroteTo()) == 0 {
		return
	}
	for tries := 0; tries < 100; tries++ {
		if c.ringSleepers() != nil || !c.bellsOwed() {
			break
		}
		c.mc.Progress()
		c.spin.Pause()
	}
	c.book.Forget()
}

// bellsOwed reports whether a peer written to in this call is owed a
// bell (its bell met a full send queue).
func (c *Comm) bellsOwed() bool {
	for _, p := range c.book.WroteTo() {
		if _, owed := c.owesBell(p); owed {
			return true
		}
	}
	return false
}

// announceSleep makes sure the peers of the pending flows know that this
// rank sleeps before it does (see above), and reports whether it may
// sleep now: false while its announcements are in flight (the sleep then
// waits for their completions, woken, and the run looks at the flows
// again) or could not be posted (the send queue is full: the wait spins
// on).
func (c *Comm) announceSleep(sends, recvs []flow) (bool, error) {
	w := &c.w
	if !c.onDemand || w.announced {
		return true, nil
	}
	if len(c.ann) > 0 {
		return false, nil // the sleep waits for them (woken)
	}
	*word(c.tx, c.sleepSrc) = c.book.NextSleep()
	src, err := c.tx.SGE(c.sleepSrc, 8)
	if err != nil {
		return false, err
	}
	for _, fs := range [2][]flow{recvs, sends} {
		for i := range fs {
			p := fs[i].peer
			if fs[i].done() || c.book.Telling(p) {
				continue
			}
			h, err := c.post(p, c.remote[p].At(uint64(c.rank*peerFlagBytes+sleepOff)), false, src)
			if err != nil {
				if errors.Is(err, verbs.ErrQueueFull) {
					// What was posted completes; the sleep after it
					// announces again, to every peer.
					c.annPartial = len(c.ann) > 0
					return false, nil
				}
				return false, c.stepErr(p, err)
			}
			c.ann = append(c.ann, h)
			c.sleepWrites++
			c.book.Told(p)
		}
	}
	if len(c.ann) == 0 {
		w.announced = true // nothing pending: waiting for its own completions
		return true, nil
	}
	return false, nil
}

// slept ends the sleep announceSleep began, once the announcements completed
// (placed at the peers): the run looks at the flows once more, and the
// next sleep is the real one. An announcement that failed leaves the
// next round's checks to find the broken peer.
func (c *Comm) slept() {
	if !c.annDone() {
		return
	}
	failed := false
	for _, h := range c.ann {
		failed = failed || h.Err() != nil
		h.Release()
	}
	c.ann = c.ann[:0]
	if !failed && !c.annPartial {
		c.w.announced = true
	}
	c.annPartial = false
}

// awake tells the peers told that this rank sleeps that it no longer
// does (their sleep words become even), when a wait ends or moves: they
// then ring only for its next sleep. The announcements may still be in
// flight: the queue pairs place this after them. Best effort: a peer
// that misses it rings once more than needed.
func (c *Comm) awake() {
	v, to := c.book.Awake()
	if len(to) == 0 {
		return
	}
	*word(c.tx, c.sleepSrc+8) = v
	src, err := c.tx.SGE(c.sleepSrc+8, 8)
	if err != nil {
		return
	}
	for _, p := range to {
		ch := c.mc.Peer(c.ranks[p])
		if c.postTwice(func() error {
			return ch.PostWriteUnsignaled(c.remote[p].At(uint64(c.rank*peerFlagBytes+sleepOff)), src)
		}) == nil {
			c.sleepWrites++
		}
	}
}

// annDone is the part of woken that ends the sleep announceSleep began.
func (c *Comm) annDone() bool {
	for _, h := range c.ann {
		if !h.Done() {
			return false
		}
	}
	return len(c.ann) > 0
}

// releaseAnn releases the announcements' handles (Close).
func releaseAnn(hs []channel.Handle) {
	for _, h := range hs {
		h.Release()
	}
}
