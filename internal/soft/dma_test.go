package soft

import (
	"bytes"
	"testing"
)

// dmaCopy must do what copy does, overlapping or not, in race builds
// (its own loop) and others.
func TestDMACopy(t *testing.T) {
	for _, n := range []int{0, 1, 7, 8, 9, 63, 64, 65, 1000} {
		for _, shift := range []int{-9, -1, 0, 1, 8, 13} {
			buf := make([]byte, 2*n+40)
			for i := range buf {
				buf[i] = byte(i*7 + 3)
			}
			want := bytes.Clone(buf)
			src, dst := 20, 20+shift
			wn := copy(want[dst:dst+n], want[src:src+n])
			gn := dmaCopy(buf[dst:dst+n], buf[src:src+n])
			if gn != wn || !bytes.Equal(buf, want) {
				t.Errorf("n=%d shift=%d: dmaCopy differs from copy (%d vs %d bytes)", n, shift, gn, wn)
			}
		}
	}
	if n := dmaCopy(make([]byte, 3), make([]byte, 5)); n != 3 {
		t.Errorf("dmaCopy into 3 bytes from 5 copied %d", n)
	}
}

func TestDMAAtomics(t *testing.T) {
	w := uint64(40)
	if old := dmaFetchAdd(&w, 2); old != 40 || w != 42 {
		t.Errorf("fetch-add: old %d, word %d; want 40, 42", old, w)
	}
	if old := dmaCompareSwap(&w, 41, 7); old != 42 || w != 42 {
		t.Errorf("compare-swap that must fail: old %d, word %d; want 42, 42", old, w)
	}
	if old := dmaCompareSwap(&w, 42, 7); old != 42 || w != 7 {
		t.Errorf("compare-swap: old %d, word %d; want 42, 7", old, w)
	}
}
