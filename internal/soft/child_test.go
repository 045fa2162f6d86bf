package soft

import (
	"bufio"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/goverbs/verbs/internal/prov"
)

// Tests that need a soft0 process of their own (its resource limits, its
// memory, its death) re-execute the test binary (internal/testproc) with
// envTestChild set to a mode; TestMain runs the mode instead of the
// tests.
const envTestChild = "GOVERBS_SOFT_TEST_CHILD"

// childModes are the child processes' programs. Each talks to its parent
// on stdin and stdout, a line at a time, and returns the exit status.
var childModes = map[string]func(in *bufio.Scanner, out io.Writer) int{
	"listener": childListener,
	"rss":      rssChild,
}

func runChild(mode string) int {
	f := childModes[mode]
	if f == nil {
		fmt.Fprintf(os.Stderr, "unknown child mode %q\n", mode)
		return 2
	}
	return f(bufio.NewScanner(os.Stdin), os.Stdout)
}

// childListener starts the soft service (with a RC QP), prints its QP's
// provider address ("addr HEX"), and exits when told ("exit") or when
// its stdin closes.
func childListener(in *bufio.Scanner, out io.Writer) int {
	ctx, err := New().Open(DeviceName)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer ctx.Close()
	pd, err := ctx.AllocPD()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer pd.Close()
	cq, err := ctx.CreateCQ(16, nil, 0)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer cq.Close()
	q, err := pd.CreateQP(prov.QPInitAttr{Type: prov.QPTypeRC, SendCQ: cq, RecvCQ: cq, Cap: defaultCaps()})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer q.Close()
	fmt.Fprintf(out, "addr %s\n", hex.EncodeToString(q.Address()))
	for in.Scan() {
		if strings.TrimSpace(in.Text()) == "exit" {
			break
		}
	}
	return 0
}
