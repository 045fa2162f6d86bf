package soft

import (
	"bytes"
	"encoding/binary"
	"os"
	"os/exec"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// selfPull is a pullSrc reading this process (as a peer reads the
// requester), with a pidfd of it.
func selfPull(t *testing.T, pieces ...[]byte) *pullSrc {
	t.Helper()
	fd, err := unix.PidfdOpen(os.Getpid(), 0)
	if err != nil {
		t.Skipf("no pidfd on this kernel: %v", err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	ps := &pullSrc{pid: os.Getpid(), pidfd: fd}
	for _, p := range pieces {
		ps.remote[ps.n] = unix.RemoteIovec{Base: uintptr(unsafe.Pointer(unsafe.SliceData(p))), Len: len(p)}
		ps.n++
	}
	var probe [8]byte
	local := []unix.Iovec{{Base: &probe[0]}}
	local[0].SetLen(8)
	remote := []unix.RemoteIovec{{Base: uintptr(unsafe.Pointer(&pullProbe[0])), Len: 8}}
	if _, err := unix.ProcessVMReadv(os.Getpid(), local, remote, 0); err != nil {
		t.Skipf("process_vm_readv is not allowed here: %v", err)
	}
	return ps
}

func spansOf(bufs ...[]byte) []span {
	var s []span
	for _, b := range bufs {
		s = append(s, span{unsafe.Pointer(unsafe.SliceData(b)), len(b)})
	}
	return s
}

// TestPullRead: the pieces of a pulled payload land in the destination's
// spans in order, from an offset on; a destination too short, an
// address that is not mapped, or a process that exited fails the read
// (and writes nothing past the destination).
func TestPullRead(t *testing.T) {
	a, b := bytes.Repeat([]byte{0xA1}, 5000), bytes.Repeat([]byte{0xB2}, 70000)
	want := append(append([]byte{}, a...), b...)
	for _, tc := range []struct {
		name string
		dst  []int // sizes of the destination's spans
		off  int
		ok   bool
	}{
		{"OneSpan", []int{75000}, 0, true},
		{"ThreeSpans", []int{4096, 100, 70804}, 0, true},
		{"Offset", []int{40, 75000}, 40, true},
		{"OffsetInsideASpan", []int{100, 74960}, 60, true},
		{"TooShort", []int{74999}, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ps := selfPull(t, a, b)
			var dst [][]byte
			for _, n := range tc.dst {
				dst = append(dst, bytes.Repeat([]byte{0xEE}, n+16)[:n])
			}
			if got := ps.read(spansOf(dst...), tc.off); got != tc.ok {
				t.Fatalf("read = %v, want %v", got, tc.ok)
			}
			all := bytes.Join(dst, nil)
			if !tc.ok {
				if !bytes.Equal(all, bytes.Repeat([]byte{0xEE}, len(all))) {
					t.Errorf("a refused read wrote into the destination")
				}
				return
			}
			if !bytes.Equal(all[tc.off:], want) {
				t.Errorf("pulled bytes differ from the source")
			}
			for i, d := range dst {
				if tail := d[len(d) : len(d)+16]; !bytes.Equal(tail, bytes.Repeat([]byte{0xEE}, 16)) {
					t.Errorf("span %d: bytes past its end changed", i)
				}
			}
		})
	}
	t.Run("UnmappedPiece", func(t *testing.T) {
		m, err := unix.Mmap(-1, 0, 2*4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Munmap(m)
		if err := unix.MunmapPtr(unsafe.Pointer(&m[4096]), 4096); err != nil { // the second page goes
			t.Fatal(err)
		}
		ps := selfPull(t, m[:8192])
		dst := make([]byte, 8192)
		if ps.read(spansOf(dst), 0) {
			t.Errorf("a read of an unmapped page succeeded")
		}
	})
	t.Run("ProcessExited", func(t *testing.T) {
		cmd := exec.Command("true")
		if err := cmd.Start(); err != nil {
			t.Skip(err)
		}
		fd, err := unix.PidfdOpen(cmd.Process.Pid, 0)
		if err != nil {
			t.Skipf("no pidfd: %v", err)
		}
		defer unix.Close(fd)
		if !peerLives(fd) {
			// It may already have ended; the check must say so below.
			t.Log("the child ended before the first look")
		}
		cmd.Wait()
		if peerLives(fd) {
			t.Errorf("peerLives of an exited process = true")
		}
		ps := selfPull(t, a)
		ps.pidfd = fd // the data came from a process that is gone
		if ps.read(spansOf(make([]byte, len(a))), 0) {
			t.Errorf("a read from an exited requester succeeded")
		}
	})
}

// TestParsePull: the pieces must cover the message exactly, lie in the
// address space, and come on a connection that offered pulling.
func TestParsePull(t *testing.T) {
	piece := func(a, n uint64) []byte {
		var b [pullDesc]byte
		binary.LittleEndian.PutUint64(b[:], a)
		binary.LittleEndian.PutUint64(b[8:], n)
		return b[:]
	}
	for _, tc := range []struct {
		name   string
		pieces []byte
		length uint32
		served bool
		ok     bool
	}{
		{"Exact", append(piece(0x10000, 100), piece(0x20000, 28)...), 128, true, true},
		{"NotOffered", piece(0x10000, 128), 128, false, false},
		{"Short", piece(0x10000, 100), 128, true, false},
		{"Long", piece(0x10000, 200), 128, true, false},
		{"EmptyPiece", append(piece(0x10000, 0), piece(0x20000, 128)...), 128, true, false},
		{"Wraps", piece(^uint64(0)-10, 128), 128, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &conn{pidfd: 3}
			c.pullServed.Store(tc.served)
			_, err := c.parsePull(spansOf(tc.pieces), len(tc.pieces), tc.length)
			if (err == nil) != tc.ok {
				t.Errorf("parsePull: %v, want ok %v", err, tc.ok)
			}
		})
	}
}
