package verbs

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// CheckMemlock reports, before registering n bytes with a hardware device,
// whether RLIMIT_MEMLOCK allows it, with the fix when it does not. (The soft
// provider does not lock memory and skips the check.)
func CheckMemlock(n int) error {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &lim); err != nil {
		return nil // cannot tell; let registration decide
	}
	if lim.Cur == unix.RLIM_INFINITY || uint64(n) <= lim.Cur {
		return nil
	}
	return fmt.Errorf("verbs: registering %d bytes exceeds the locked-memory limit RLIMIT_MEMLOCK of %d bytes: "+
		"raise it with `ulimit -l unlimited` (shell), LimitMEMLOCK=infinity (systemd unit), "+
		"`* - memlock unlimited` in /etc/security/limits.conf, or --ulimit memlock=-1 (containers): %w",
		n, lim.Cur, unix.ENOMEM)
}
