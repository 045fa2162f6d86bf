#!/usr/bin/env bash
# scripts/vm/run.sh — run a host-built command inside a throwaway QEMU VM that
# has two SoftRoCE (rdma_rxe) devices, rxe0 and rxe1, joined by a veth pair.
#
# Tier 3 of the test plan (shared/DESIGN.md section 5): the host kernel has no
# RDMA support, so the hardware provider (internal/ibv, cgo over libibverbs) is
# exercised against the real kernel rxe driver inside a Debian 6.1 guest.
#
# Usage:
#   scripts/vm/run.sh [OPTIONS] -- CMD [ARGS...]
#   scripts/vm/run.sh --prepare          # install packages, build the cache, don't boot
#
#   CMD is a host path (absolute, or relative to the current directory), run
#   inside the guest in a chroot of the host's root filesystem (shared
#   read-only over 9p), so host-built binaries run with the host's libraries.
#   The current directory is kept (when it exists in the guest). CMD's stdout
#   and stderr are streamed to this script's stdout and stderr, and the script
#   exits with CMD's exit status.
#
# Options:
#   --timeout SECS   kill the VM after SECS seconds (default: $GOVERBS_VM_TIMEOUT,
#                    else a Go test binary's -test.timeout + 60, else 600);
#                    exit status 124 then. A guest that has not started its
#                    init within $GOVERBS_VM_BOOT_WAIT seconds (default 180)
#                    is stopped and booted once more (exit status 125 if it
#                    hangs again)
#   --env NAME[=VAL] pass NAME (from this environment, or set to VAL) into the
#                    guest; repeatable. GOVERBS_*, GOTRACEBACK, GODEBUG,
#                    GOMAXPROCS, GOGC, GOMEMLIMIT, GORACE, PATH, LANG, LC_ALL
#                    and TZ are always passed
#   --mtu N          MTU of veth0/veth1 (default 1500 -> rxe active_mtu 1024;
#                    use 4200+ for active_mtu 4096), or $GOVERBS_VM_MTU
#   --mem SIZE       guest memory (default 2G), --smp N guest CPUs (default 2)
#   --kernel-args A  more guest kernel command-line arguments (appended), or
#                    $GOVERBS_VM_KARGS; e.g. "clocksource=hpet" for the
#                    clock source the guest picks by itself (see below)
#   --cpu MODEL      QEMU CPU model (default qemu64: x86-64-v1, no SSE4/AVX, so
#                    binaries built with GOAMD64=v2+ need --cpu max; max makes
#                    rxe ~35% slower under TCG, hence not the default)
#   --keep           keep the per-run directory .cache/vm/out-* (always kept
#                    when the VM itself fails)
#   -v, --verbose    print progress and the guest's console log on stderr
#   --prepare        only install/fetch/build what is needed, then exit 0
#   -h, --help       this text
#
# Inside the guest:
#   - rxe0 (over veth0) and rxe1 (over veth1), both PORT_ACTIVE; no IP
#     addresses: GID index 0 is the link-local (fe80::) RoCE v2 GID. Network:
#     loopback and the veth pair only (no NIC, nothing leaves the VM).
#   - root, `ulimit -l unlimited`, HOME=/tmp; /tmp, /var/tmp, /run, /dev/shm
#     are the guest's own tmpfs (empty, writable); everything else is the
#     host's filesystem, read-only, except the per-run directory.
#   - The guest's clock source is the TSC (clocksource=tsc tsc=reliable),
#     as on any current real machine: qemu64 does not announce an
#     invariant TSC, so the guest would fall back to the HPET, where every
#     clock_gettime/gettimeofday is a system call of ~2 us instead of a
#     vDSO read. That taxes programs by how often they read the clock (the
#     Go runtime's scheduler and sysmon read it often; perftest reads it
#     per BW sample), not by what they do with RDMA. TCG derives the guest
#     TSC from the host clock, so it is monotonic and the same on every
#     vCPU.
#   - GOVERBS_VM=1, GOVERBS_VM_DEVICES=rxe0,rxe1 and
#     GOVERBS_VM_ADDRS=rxe0=fe80::..%veth0,rxe1=fe80::..%veth1 are set. The
#     latter are the IPv6 link-local addresses for RDMA CM (rdma_cm cannot use
#     127.0.0.1 here); IPv6 duplicate address detection is off, so they (and
#     GID 0) are usable as soon as CMD starts.
#   - Host files under /tmp, /var/tmp, /run or /dev/shm are not visible, so a
#     CMD under those is copied into the per-run directory first (this is
#     what makes `go test -exec` work); other binaries should live in the
#     repository, e.g. .cache/vm/bin.
#   - Output-file flags of Go test binaries (-test.coverprofile=, -test.gocoverdir=,
#     -test.cpuprofile=, -test.outputdir=, ...; `=` form only) are redirected
#     into the per-run directory and copied back afterwards, so
#     `go test -cover -exec ...` works.
#
# Examples:
#   scripts/vm/run.sh -- ibv_devinfo
#   go test -c -tags ibverbs -o .cache/vm/bin/ibv.test ./internal/ibv &&
#     scripts/vm/run.sh --timeout 300 -- .cache/vm/bin/ibv.test -test.v
#   go test -tags ibverbs -exec "$PWD/scripts/vm/run.sh --" ./internal/ibv/...
#   scripts/vm/perftest.sh ib_write_bw -s 65536
#   scripts/vm/compare.sh           # goverbs bench vs perftest, ratios, one boot
#   scripts/vm/selftest.sh          # the harness's own end-to-end check
#
# First run on a fresh Debian 12 machine (as root): apt-get installs the
# packages below, one Debian kernel package (linux-image-6.1.0-NN-amd64, the
# one linux-image-amd64 depends on, or $GOVERBS_VM_KERNEL) is downloaded and
# unpacked into .cache/vm/, and an initramfs is built there; later runs reuse
# the cache and need neither root nor apt (~30-50 s cold, with downloads).
# A warm run costs ~5 s of boot and setup under TCG (the kernel boots by PVH
# from an uncompressed vmlinux extracted into the cache); KVM is not used: a
# KVM guest hangs on these machines. Everything is slow under TCG (perftest
# ib_write_bw ~50 MB/s, ~16 us write latency), and noisy when the host is
# busy: compare numbers only within one run.
#
# GOVERBS_VM_CACHE=DIR moves the cache (default .cache/vm in the repository,
# or /var/cache/goverbs-vm when the repository is where the guest cannot see it),
# e.g. to share it between clones; it must not be under /tmp, /var/tmp, /run
# or /dev/shm.
#
# Concurrent runs are fine (each has its own run directory; the cache is built
# under a lock), e.g. `go test -exec` over several packages.
#
# Exit status: CMD's, or 124 on timeout, or 125 when the harness or the VM
# failed (the message names what failed).

set -euo pipefail

SCRIPT_DIR=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)
REPO_ROOT=$(cd -- "$SCRIPT_DIR/../.." && pwd -P)
# hidden_from_guest PATH: the guest mounts its own /tmp, /var/tmp, /run and
# /dev/shm over the host's, so it cannot see paths below them.
hidden_from_guest() {
	case $1 in
	/tmp | /tmp/* | /var/tmp | /var/tmp/* | /run | /run/* | /dev/shm | /dev/shm/*) return 0 ;;
	esac
	return 1
}
if [[ -n ${GOVERBS_VM_CACHE:-} ]]; then
	CACHE=$GOVERBS_VM_CACHE
	case $CACHE in
	/*) ;;
	*) CACHE=$PWD/$CACHE ;;
	esac
	if hidden_from_guest "$CACHE"; then
		echo "vm: error: GOVERBS_VM_CACHE=$CACHE: the guest cannot see /tmp, /var/tmp, /run or /dev/shm of the host" >&2
		exit 125
	fi
else
	CACHE=$REPO_ROOT/.cache/vm
	# A checkout under /tmp (CI may clone there): keep the cache where the
	# guest can see it.
	if hidden_from_guest "$CACHE"; then
		if [[ -w /var/cache ]]; then
			CACHE=/var/cache/goverbs-vm
		else
			CACHE=${HOME:?}/.cache/goverbs-vm
		fi
	fi
fi

PACKAGES=(qemu-system-x86 busybox-static cpio kmod libibverbs-dev ibverbs-providers
	ibverbs-utils librdmacm-dev rdmacm-utils perftest iproute2 xz-utils)
# Loaded in this order (with their dependencies) by the initramfs.
MODULES=(virtio_pci 9pnet_virtio 9p virtio_rng crc32_generic rdma_rxe rdma_ucm veth)
PASS_ENV_RE='^(GOVERBS_[A-Za-z0-9_]*|GOTRACEBACK|GODEBUG|GOMAXPROCS|GOGC|GOMEMLIMIT|GORACE|PATH|LANG|LC_ALL|TZ)$'

timeout_s=${GOVERBS_VM_TIMEOUT:-600}
# boot_wait is how long a guest may take to start its init (see boot).
boot_wait=${GOVERBS_VM_BOOT_WAIT:-180}
timeout_set=${GOVERBS_VM_TIMEOUT:+1}
mtu=${GOVERBS_VM_MTU:-1500}
mem=2G
smp=2
cpu=qemu64
kargs=${GOVERBS_VM_KARGS:-}
keep=0
verbose=0
prepare_only=0
extra_env=()

say() { echo "vm: $*" >&2; }
info() { if ((verbose)); then say "$@"; fi; }
die() {
	echo "vm: error: $*" >&2
	exit 125
}
usage() {
	sed -n '2,/^$/{s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
}

while (($#)); do
	case $1 in
	--timeout) (($# >= 2)) || die "--timeout needs a value"; timeout_s=$2; timeout_set=1; shift 2 ;;
	--timeout=*) timeout_s=${1#*=}; timeout_set=1; shift ;;
	--env) (($# >= 2)) || die "--env needs a value"; extra_env+=("$2"); shift 2 ;;
	--env=*) extra_env+=("${1#*=}"); shift ;;
	--mtu) (($# >= 2)) || die "--mtu needs a value"; mtu=$2; shift 2 ;;
	--mtu=*) mtu=${1#*=}; shift ;;
	--mem) (($# >= 2)) || die "--mem needs a value"; mem=$2; shift 2 ;;
	--smp) (($# >= 2)) || die "--smp needs a value"; smp=$2; shift 2 ;;
	--cpu) (($# >= 2)) || die "--cpu needs a value"; cpu=$2; shift 2 ;;
	--kernel-args) (($# >= 2)) || die "--kernel-args needs a value"; kargs=$2; shift 2 ;;
	--kernel-args=*) kargs=${1#*=}; shift ;;
	--keep) keep=1; shift ;;
	-v | --verbose) verbose=1; shift ;;
	--prepare) prepare_only=1; shift ;;
	-h | --help) usage; exit 0 ;;
	--) shift; break ;;
	-*) die "unknown option $1 (see --help)" ;;
	*) break ;;
	esac
done
[[ $timeout_s =~ ^[0-9]+$ ]] || die "--timeout must be a number of seconds, got '$timeout_s'"
[[ $mtu =~ ^[0-9]+$ ]] || die "--mtu must be a number, got '$mtu'"
[[ $smp =~ ^[0-9]+$ ]] || die "--smp must be a number, got '$smp'"
if ((!prepare_only)) && (($# == 0)); then
	usage >&2
	die "no command given (usage: run.sh [OPTIONS] -- CMD [ARGS...])"
fi

# go_seconds prints a Go duration ("10m0s", "1h", "90s") in whole seconds.
go_seconds() {
	awk -v d="$1" 'BEGIN {
		if (d !~ /^([0-9.]+(h|m|s|ms|us|µs|ns))+$/) exit 1
		t = 0
		while (match(d, /^[0-9.]+(h|ms|m|s|us|µs|ns)/)) {
			tok = substr(d, 1, RLENGTH); d = substr(d, RLENGTH + 1)
			n = tok + 0; u = tok; sub(/^[0-9.]+/, "", u)
			t += n * (u == "h" ? 3600 : u == "m" ? 60 : u == "s" ? 1 : u == "ms" ? 0.001 : 0)
		}
		printf "%d\n", t + 0.999
	}'
}

# A Go test binary run by `go test -exec` gets -test.timeout (10m by
# default): unless --timeout was given, let the VM outlive it by a minute so
# that the test's own timeout panic (with its goroutine dump) is seen.
if ((!timeout_set)); then
	for ((i = 2; i <= $#; i++)); do
		a=${!i}
		case $a in
		-test.timeout=* | --test.timeout=*) d=${a#*=} ;;
		-test.timeout | --test.timeout) j=$((i + 1)); d=${!j:-} ;;
		*) continue ;;
		esac
		if s=$(go_seconds "$d") && ((s > 0)); then timeout_s=$((s + 60)); fi
	done
fi

mkdir -p "$CACHE" || die "cannot create cache directory $CACHE"
[[ -e $CACHE/.gitignore ]] || echo '*' >"$CACHE/.gitignore"
# Run directories of failed runs are kept for a day.
find "$CACHE" -maxdepth 1 -name 'out-*' -type d -mmin +1440 -exec rm -rf {} + 2>/dev/null || true

# ---------------------------------------------------------------- packages --

ensure_packages() {
	local missing=() p installed
	installed=" $(dpkg-query -W -f='${Package}=${db:Status-Status} ' "${PACKAGES[@]}" 2>/dev/null || true)"
	for p in "${PACKAGES[@]}"; do
		[[ $installed == *" $p=installed "* ]] || missing+=("$p")
	done
	((${#missing[@]})) || return 0
	((EUID == 0)) || die "missing Debian packages: ${missing[*]} (run once as root, or: sudo apt-get install ${missing[*]})"
	say "installing ${missing[*]}"
	local log=$CACHE/apt.log
	if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >"$log" 2>&1; then
		apt-get update -q >>"$log" 2>&1 || die "apt-get update failed (see $log)"
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$log" 2>&1 ||
			die "apt-get install ${missing[*]} failed (see $log)"
	fi
}

# ------------------------------------------------------------------ kernel --

# kernel_pkg_candidate prints the newest linux-image-6.1.0-NN-amd64 package
# name known to apt (the one the linux-image-amd64 meta-package depends on).
kernel_pkg_candidate() {
	apt-cache show --no-all-versions linux-image-amd64 2>/dev/null |
		sed -n 's/^Depends:.*\(linux-image-6\.1\.0-[0-9]*-amd64\).*/\1/p' | head -n1
}

# ensure_kernel sets KPKG, KVER (uname -r of the guest) and KDIR.
ensure_kernel() {
	KPKG=${GOVERBS_VM_KERNEL:-}
	if [[ -z $KPKG && -s $CACHE/kernel.pkg ]]; then
		KPKG=$(<"$CACHE/kernel.pkg")
	fi
	if [[ -n $KPKG && -e $CACHE/$KPKG/.complete ]]; then
		KDIR=$CACHE/$KPKG
		KVER=${KPKG#linux-image-}
		[[ $(<"$CACHE/kernel.pkg") == "$KPKG" ]] 2>/dev/null || echo "$KPKG" >"$CACHE/kernel.pkg"
		return 0
	fi
	if [[ -z $KPKG ]]; then
		KPKG=$(kernel_pkg_candidate)
		if [[ -z $KPKG ]]; then
			((EUID == 0)) && apt-get update -q >"$CACHE/apt.log" 2>&1
			KPKG=$(kernel_pkg_candidate)
		fi
		[[ -n $KPKG ]] || die "kernel package not found: apt knows no linux-image-6.1.0-NN-amd64 (is this Debian 12 with its package lists? try apt-get update)"
	fi
	[[ $KPKG =~ ^linux-image-[0-9][-.0-9a-z+]*-amd64$ ]] || die "kernel package name '$KPKG' is not linux-image-<version>-amd64"
	KVER=${KPKG#linux-image-}
	KDIR=$CACHE/$KPKG
	say "fetching kernel package $KPKG"
	local tmp
	tmp=$(mktemp -d "$CACHE/dl.XXXXXX")
	if ! (cd "$tmp" && apt-get download -q -o APT::Sandbox::User=root "$KPKG" >"$tmp/log" 2>&1); then
		# Stale package lists name a file the archive no longer has: refresh once.
		if ((EUID == 0)) && apt-get update -q >>"$tmp/log" 2>&1 &&
			(cd "$tmp" && apt-get download -q -o APT::Sandbox::User=root "$KPKG" >>"$tmp/log" 2>&1); then
			:
		else
			sed 's/^/vm: apt: /' "$tmp/log" >&2
			rm -rf "$tmp"
			die "kernel package not found or download failed: $KPKG (set GOVERBS_VM_KERNEL=linux-image-6.1.0-NN-amd64 to choose another)"
		fi
	fi
	local deb
	deb=$(find "$tmp" -maxdepth 1 -name '*.deb' -print -quit)
	[[ -n $deb ]] || { rm -rf "$tmp"; die "apt-get download $KPKG produced no .deb"; }
	dpkg -x "$deb" "$tmp/root" || { rm -rf "$tmp"; die "dpkg -x failed on $deb"; }
	dpkg-deb -f "$deb" Version >"$tmp/root/.version"
	[[ -f $tmp/root/boot/vmlinuz-$KVER ]] || { rm -rf "$tmp"; die "$KPKG has no boot/vmlinuz-$KVER"; }
	[[ -n $(find "$tmp/root/lib/modules/$KVER" -name 'rdma_rxe.ko*' -print -quit) ]] ||
		{ rm -rf "$tmp"; die "$KPKG has no rdma_rxe module"; }
	depmod -b "$tmp/root" "$KVER" || { rm -rf "$tmp"; die "depmod failed on the unpacked $KPKG"; }
	touch "$tmp/root/.complete"
	rm -rf "$KDIR"
	mv "$tmp/root" "$KDIR"
	rm -rf "$tmp"
	echo "$KPKG" >"$CACHE/kernel.pkg"
}

# ensure_boot_image sets BOOTIMG: the uncompressed vmlinux when the kernel
# supports PVH boot (QEMU then skips the BIOS and the in-guest XZ
# decompression, which under TCG saves 2-3 s a boot), else the bzImage.
ensure_boot_image() {
	BOOTIMG=$KDIR/boot/vmlinuz-$KVER
	local pvh=$KDIR/boot/vmlinux-$KVER.pvh
	if [[ -s $pvh ]]; then
		BOOTIMG=$pvh
		return 0
	fi
	[[ ! -e $pvh.none ]] || return 0
	if grep -q '^CONFIG_PVH=y' "$KDIR/boot/config-$KVER" 2>/dev/null; then
		local off
		off=$(LC_ALL=C grep -m1 -obUa $'\xfd7zXZ' "$BOOTIMG" | cut -d: -f1) || true
		# (xz stops at the end of the stream: tail's SIGPIPE is expected.)
		if [[ -n $off ]] &&
			xz -dc --single-stream <(tail -c +$((off + 1)) "$BOOTIMG") >"$pvh.tmp" 2>/dev/null &&
			[[ $(head -c4 "$pvh.tmp" | od -An -tx1 | tr -d ' ') == 7f454c46 ]]; then
			mv "$pvh.tmp" "$pvh"
			BOOTIMG=$pvh
			return 0
		fi
	fi
	rm -f "$pvh.tmp"
	info "no PVH vmlinux could be extracted from $BOOTIMG; booting the bzImage"
	touch "$pvh.none"
}

# --------------------------------------------------------------- initramfs --

# The guest's /init (busybox ash). It reads /out/job.conf (GV_OUT: the host
# path of the per-run directory; GV_MTU), sets up RDMA and the chroot, runs
# GV_OUT/job.sh in the chroot and writes GV_OUT/status.
read -r -d '' INIT_SCRIPT <<'EOF' || true
#!/bin/sh
PATH=/bin
export PATH
mount -t devtmpfs devtmpfs /dev 2>/dev/null
exec </dev/console >/dev/console 2>&1
mount -t proc proc /proc
mount -t sysfs sysfs /sys

say() { echo "goverbs-vm: [$(cut -d' ' -f1 /proc/uptime)s] $*"; }
off() {
	sync
	poweroff -f
	sleep 2
	reboot -f
}
fail() {
	say "FATAL: $*"
	if [ -f /out/job.conf ]; then echo "$*" >/out/init-error; fi
	off
}
modload() {
	for m in "$@"; do
		modprobe "$m" || fail "$m failed to load"
	done
}
# hrun runs a host program inside the chroot with a clean environment.
hrun() { chroot /host /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin "$@"; }

say "init started"
modload virtio_pci 9pnet_virtio 9p
mkdir -p /host /out
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,cache=none results /out ||
	fail "mounting the results share failed"
[ -f /out/job.conf ] || fail "no job.conf in the results share"
. /out/job.conf
modload $(cat /modules.load)
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,ro,cache=loose hostroot /host ||
	fail "mounting the host root (9p hostroot) failed"
[ -d "/host$GV_OUT" ] || fail "$GV_OUT does not exist in the host root"
mount -o bind /out "/host$GV_OUT" || fail "bind-mounting the results share on $GV_OUT failed"
mount -t proc proc /host/proc || fail "mount proc in chroot failed"
mount -t sysfs sysfs /host/sys || fail "mount sysfs in chroot failed"
mount -t devtmpfs devtmpfs /host/dev || fail "mount devtmpfs in chroot failed"
mkdir -p /host/dev/pts /host/dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts /host/dev/pts || fail "mount devpts failed"
mount -t tmpfs -o mode=1777 tmpfs /host/dev/shm || fail "mount /dev/shm failed"
for d in /tmp /var/tmp /run; do
	mount -t tmpfs -o mode=1777 tmpfs "/host$d" || fail "mount tmpfs on $d failed"
done
[ -x /host/usr/bin/env ] || fail "/usr/bin/env missing on the host"

hrun ip link set lo up || fail "ip link set lo up failed"
# No IPv6 duplicate address detection: the veth link-local addresses (which
# RoCE v2 GID 0 resolves through) are usable at once, not tentative for ~2 s.
echo 0 >/proc/sys/net/ipv6/conf/default/accept_dad || fail "disabling IPv6 DAD failed"
hrun ip link add veth0 mtu "$GV_MTU" type veth peer name veth1 mtu "$GV_MTU" || fail "creating veth0/veth1 failed"
hrun ip link set veth0 up || fail "ip link set veth0 up failed"
hrun ip link set veth1 up || fail "ip link set veth1 up failed"
hrun rdma link add rxe0 type rxe netdev veth0 || fail "rdma link add rxe0 (netdev veth0) failed"
hrun rdma link add rxe1 type rxe netdev veth1 || fail "rdma link add rxe1 (netdev veth1) failed"
n=0
for d in rxe0 rxe1; do
	while ! grep -q ACTIVE "/sys/class/infiniband/$d/ports/1/state" 2>/dev/null ||
		grep -q '^0000:0000:0000:0000' "/sys/class/infiniband/$d/ports/1/gids/0" 2>/dev/null; do
		n=$((n + 1))
		[ $n -lt 100 ] || fail "$d port did not become ACTIVE with a GID"
		sleep 0.1
	done
done
# GID 0 is resolved through the veth's IPv6 link-local address: wait for it.
while [ "$(grep -c ' veth[01]$' /proc/net/if_inet6)" -lt 2 ]; do
	n=$((n + 1))
	[ $n -lt 100 ] || fail "veth0/veth1 got no IPv6 link-local address"
	sleep 0.1
done
[ -e /host/dev/infiniband/uverbs0 ] || fail "/dev/infiniband/uverbs0 missing (ib_uverbs)"
ulimit -l unlimited || fail "ulimit -l unlimited failed"
ulimit -n 65536 2>/dev/null
say "rxe0, rxe1 ready; running job"

hrun /bin/bash "$GV_OUT/job.sh" </dev/null >>/out/stdout 2>>/out/stderr
echo $? >/out/status.tmp
mv /out/status.tmp /out/status
say "job exited with status $(cat /out/status)"
off
EOF

# ensure_initramfs sets INITRD (cached by content hash of its inputs).
ensure_initramfs() {
	local mods=() m deps w path
	for m in "${MODULES[@]}"; do
		deps=$(modprobe -d "$KDIR" -S "$KVER" --show-depends "$m" 2>&1) ||
			die "module $m not found in $KPKG: $deps"
		while read -r w path _; do
			[[ $w == insmod ]] && mods+=("${path#"$KDIR/lib/modules/$KVER/"}")
		done <<<"$deps"
	done
	local key
	key=$( {
		echo "$KPKG $(cat "$KDIR/.version" 2>/dev/null)"
		printf '%s\n' "${MODULES[@]}" "${mods[@]}"
		echo "$INIT_SCRIPT"
		sha256sum /bin/busybox
	} | sha256sum | cut -c1-16)
	INITRD=$CACHE/initramfs-$KVER-$key.cpio.gz
	[[ -s $INITRD ]] && return 0
	info "building $INITRD"
	local st
	st=$(mktemp -d "$CACHE/initramfs.XXXXXX")
	mkdir -p "$st"/{bin,dev,proc,sys,host,out,lib/modules/"$KVER"}
	cp /bin/busybox "$st/bin/busybox" || die "busybox-static (/bin/busybox) missing"
	local a
	for a in sh mount umount mkdir modprobe insmod chroot poweroff reboot cat echo sleep \
		ls grep cut mv sync dmesg uname ip; do
		ln -s busybox "$st/bin/$a"
	done
	for m in "${mods[@]}"; do
		mkdir -p "$st/lib/modules/$KVER/$(dirname "$m")"
		cp "$KDIR/lib/modules/$KVER/$m" "$st/lib/modules/$KVER/$m"
	done
	for m in modules.order modules.builtin modules.builtin.modinfo; do
		[[ -f $KDIR/lib/modules/$KVER/$m ]] && cp "$KDIR/lib/modules/$KVER/$m" "$st/lib/modules/$KVER/"
	done
	depmod -b "$st" "$KVER" || die "depmod failed on the initramfs tree"
	printf '%s\n' "${MODULES[@]}" >"$st/modules.load"
	printf '%s\n' "$INIT_SCRIPT" >"$st/init"
	chmod 755 "$st/init"
	if ((EUID == 0)); then mknod -m 600 "$st/dev/console" c 5 1; fi
	(cd "$st" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --quiet -R 0:0 | gzip -1) >"$INITRD.tmp" ||
		die "building the initramfs (cpio) failed"
	mv "$INITRD.tmp" "$INITRD"
	rm -rf "$st"
	find "$CACHE" -maxdepth 1 -name 'initramfs-*.cpio.gz' ! -name "$(basename "$INITRD")" -delete
}

prepare() {
	exec 9>"$CACHE/.lock"
	flock 9 || die "cannot lock $CACHE/.lock"
	ensure_packages
	ensure_kernel
	ensure_boot_image
	ensure_initramfs
	exec 9>&-
}

t_start=$(date +%s.%N)
prepare
info "kernel $KPKG ($(cat "$KDIR/.version" 2>/dev/null)), $(basename "$BOOTIMG"), initramfs $(basename "$INITRD")"
if ((prepare_only)); then
	echo "vm: ready: $KPKG $(cat "$KDIR/.version" 2>/dev/null), $(basename "$INITRD")" >&2
	exit 0
fi

# ----------------------------------------------------------------- the job --

cmd=$1
shift
if [[ $cmd != */* ]]; then
	resolved=$(type -P -- "$cmd") || die "command not found on the host: $cmd"
	cmd=$resolved
fi
[[ $cmd == /* ]] || cmd=$PWD/$cmd
[[ -e $cmd ]] || die "command not found on the host: $cmd"
[[ -x $cmd ]] || die "command is not executable: $cmd"

OUT=$(mktemp -d "$CACHE/out-XXXXXX") || die "cannot create a run directory in $CACHE"
chmod 755 "$OUT"
qemu_pid=
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() {
	local rc=$?
	[[ -n $qemu_pid ]] && kill "$qemu_pid" 2>/dev/null
	if ((keep == 0 && rc != 124 && rc != 125)); then
		rm -rf "$OUT"
	else
		say "run directory kept: $OUT"
	fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 131' QUIT
trap 'exit 143' TERM

case $cmd in
/tmp/* | /var/tmp/* | /run/* | /dev/shm/*)
	mkdir -p "$OUT/bin"
	cp -- "$cmd" "$OUT/bin/" || die "cannot copy $cmd into $OUT/bin"
	cmd=$OUT/bin/$(basename -- "$cmd")
	;;
esac

guest_cwd=$PWD
case $guest_cwd in /tmp | /tmp/* | /var/tmp/* | /run/* | /dev/shm/*) guest_cwd=/ ;; esac

# The guest can write nowhere on the host but in the run directory, so the
# output files of a Go test binary (-test.coverprofile=F, -test.gocoverdir=D,
# ... as `go test -cover -exec` passes them) are redirected there and copied
# back to where they were asked for once the VM is done.
copy_back=() # pairs: guest path, host path
outputdir=
for a in "$@"; do
	case $a in -test.outputdir=* | --test.outputdir=*) outputdir=${a#*=} ;; esac
done
[[ -z $outputdir || $outputdir == /* ]] || outputdir=$PWD/$outputdir
args=()
n=0
for a in "$@"; do
	case $a in
	-test.gocoverdir=?* | --test.gocoverdir=?* | -test.outputdir=?* | --test.outputdir=?*)
		n=$((n + 1))
		host=${a#*=}
		[[ $host == /* ]] || host=$PWD/$host
		mkdir -p "$OUT/files/$n"
		copy_back+=("$OUT/files/$n/." "$host/")
		a=${a%%=*}=$OUT/files/$n
		;;
	-test.coverprofile=?* | --test.coverprofile=?* | -test.cpuprofile=?* | --test.cpuprofile=?* | \
		-test.memprofile=?* | --test.memprofile=?* | -test.blockprofile=?* | --test.blockprofile=?* | \
		-test.mutexprofile=?* | --test.mutexprofile=?* | -test.trace=?* | --test.trace=?* | \
		-test.testlogfile=?* | --test.testlogfile=?*)
		n=$((n + 1))
		host=${a#*=}
		if [[ $host != /* ]]; then
			if [[ -n $outputdir ]]; then host=$outputdir/$host; else host=$PWD/$host; fi
		fi
		mkdir -p "$OUT/files/$n"
		copy_back+=("$OUT/files/$n/$(basename -- "$host")" "$host")
		a=${a%%=*}=$OUT/files/$n/$(basename -- "$host")
		;;
	esac
	args+=("$a")
done
set -- "${args[@]+"${args[@]}"}"

q() { printf '%q' "$1"; }
[[ $OUT != *"'"* ]] || die "the repository path must not contain a single quote: $OUT"
{
	echo "GV_OUT='$OUT'"
	echo "GV_MTU=$mtu"
} >"$OUT/job.conf"
{
	echo '# generated by scripts/vm/run.sh'
	while IFS='=' read -r -d '' name value; do
		[[ $name =~ $PASS_ENV_RE ]] && echo "export $name=$(q "$value")"
	done < <(env -0)
	for e in "${extra_env[@]+"${extra_env[@]}"}"; do
		if [[ $e == *=* ]]; then
			echo "export ${e%%=*}=$(q "${e#*=}")"
		elif [[ -v $e ]]; then
			echo "export $e=$(q "${!e}")"
		fi
	done
	echo "[[ -n \${PATH:-} ]] || export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	echo "export HOME=/tmp USER=root LOGNAME=root GOVERBS_VM=1 GOVERBS_VM_DEVICES=rxe0,rxe1"
	# The IPv6 link-local address of each rxe's netdev, with its zone, for
	# RDMA CM (rdma_cm does not work over 127.0.0.1 here: no RDMA device on lo).
	cat <<'EOS'
_vm_ll() { ip -6 -o addr show dev "$1" scope link 2>/dev/null | awk -v d="$1" '{sub(/\/.*/, "", $4); print $4 "%" d; exit}'; }
export GOVERBS_VM_ADDRS="rxe0=$(_vm_ll veth0),rxe1=$(_vm_ll veth1)"
unset -f _vm_ll
EOS
	echo "cd $(q "$guest_cwd") 2>/dev/null || cd /"
	printf 'exec'
	printf ' %q' "$cmd" "$@"
	echo
} >"$OUT/job.sh"
: >"$OUT/stdout"
: >"$OUT/stderr"

qemu_args=(
	-accel tcg -cpu "$cpu" -machine pc -m "$mem" -smp "$smp"
	-nodefaults -no-user-config -display none -nic none -no-reboot
	-serial "file:$OUT/console.log"
	-kernel "$BOOTIMG" -initrd "$INITRD"
	-append "console=ttyS0 quiet loglevel=4 panic=-1 oops=panic clocksource=tsc tsc=reliable${kargs:+ $kargs}"
	-device virtio-rng-pci
	-virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap,id=hostroot"
	-virtfs "local,path=$OUT,mount_tag=results,security_model=none,id=results"
)
# boot runs the VM once: qemu_rc is qemu's status. A guest whose init has
# not said "init started" on the console within boot_wait seconds is
# stopped and reported in $OUT/boot-hung: under TCG a guest kernel hung
# once before init (an empty console, the 1260-s test timeout spent),
# which a second boot gets past.
boot() {
	: >"$OUT/console.log"
	rm -f "$OUT/boot-hung"
	info "booting (timeout ${timeout_s}s)"
	# setpriv --pdeathsig: if this script is killed (even with SIGKILL),
	# timeout gets SIGTERM and passes it on to qemu, so no VM outlives its
	# caller.
	setpriv --pdeathsig TERM timeout -k 5 "$timeout_s" qemu-system-x86_64 "${qemu_args[@]}" </dev/null >"$OUT/qemu.log" 2>&1 &
	qemu_pid=$!
	(
		for ((i = 0; i < 5 * boot_wait; i++)); do
			if grep -q "init started" "$OUT/console.log" 2>/dev/null || ! kill -0 "$qemu_pid" 2>/dev/null; then
				exit 0
			fi
			sleep 0.2
		done
		: >"$OUT/boot-hung"
		kill -TERM "$qemu_pid" 2>/dev/null
	) &
	local watch=$!
	tail -n +1 -s 0.2 -f --pid="$qemu_pid" "$OUT/stdout" &
	tail_out=$!
	tail -n +1 -s 0.2 -f --pid="$qemu_pid" "$OUT/stderr" >&2 &
	tail_err=$!
	set +e
	wait "$qemu_pid"
	qrc=$?
	set -e
	qemu_pid=
	kill "$watch" 2>/dev/null || true
	wait "$watch" "$tail_out" "$tail_err" 2>/dev/null || true
}
t_boot=$(date +%s.%N)
boot
if [[ -e $OUT/boot-hung ]]; then
	say "the guest did not start within ${boot_wait}s (nothing on its console): booting it again"
	mv "$OUT/console.log" "$OUT/console-hung.log"
	boot
	if [[ -e $OUT/boot-hung ]]; then
		say "error: the guest did not start within ${boot_wait}s, twice (command: $cmd)"
		exit 125
	fi
fi
t_end=$(date +%s.%N)
info "$(awk -v a="$t_start" -v b="$t_boot" -v c="$t_end" 'BEGIN{printf "prepare %.1fs, VM %.1fs", b-a, c-b}')"

console_tail() {
	if [[ -s $OUT/console.log ]]; then
		say "last lines of the guest console ($OUT/console.log):"
		tail -n 30 "$OUT/console.log" | sed 's/^/vm:   /' >&2
	fi
}
if ((verbose)); then
	say "guest console:"
	sed 's/^/vm:   /' "$OUT/console.log" >&2 || true
fi
if ((qrc == 124)); then
	say "error: timed out after ${timeout_s}s: the VM was killed (command: $cmd)"
	((verbose)) || console_tail
	exit 124
fi
if [[ -s $OUT/init-error ]]; then
	say "error: guest setup failed: $(<"$OUT/init-error")"
	((verbose)) || console_tail
	exit 125
fi
if [[ ! -s $OUT/status ]]; then
	say "error: the VM ended without the command's exit status (qemu exit $qrc)"
	[[ -s $OUT/qemu.log ]] && sed 's/^/vm: qemu: /' "$OUT/qemu.log" >&2
	((verbose)) || console_tail
	exit 125
fi
for ((i = 0; i < ${#copy_back[@]}; i += 2)); do
	src=${copy_back[i]} dst=${copy_back[i + 1]}
	if [[ $dst == */ ]]; then
		if ! { mkdir -p "$dst" && cp -R "$src" "$dst"; }; then say "error: cannot copy $src to $dst"; fi
	elif [[ -e $src ]]; then
		if ! { mkdir -p "$(dirname -- "$dst")" && cp "$src" "$dst"; }; then say "error: cannot copy $src to $dst"; fi
	fi
done
exit "$(<"$OUT/status")"
