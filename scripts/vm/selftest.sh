#!/usr/bin/env bash
# scripts/vm/selftest.sh — check the SoftRoCE VM harness end to end, in one
# VM boot: ibv_devices and ibv_devinfo list rxe0 and rxe1; the cgo probe
# (internal/ibv/vmprobe, built with -tags ibverbs) lists them through
# libibverbs from Go; a Go test binary (internal/vmtest) passes with -test.v;
# and a short perftest ib_write_bw runs between rxe0 and rxe1.
#
# Usage: scripts/vm/selftest.sh [RUN_OPTIONS]   (options of scripts/vm/run.sh)
# Exit status 0 when everything passed.

# shellcheck disable=SC2317 # the guest-side helpers are called through step
set -euo pipefail

here=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)

if [[ ${GOVERBS_VM:-} == 1 ]]; then
	# In the guest: $1 is the directory with the binaries.
	bin=$1
	failed=()
	step() {
		local name=$1
		shift
		echo "---- selftest: $name"
		if "$@"; then
			echo "---- selftest: $name: ok"
		else
			echo "---- selftest: $name: FAILED"
			failed+=("$name")
		fi
	}
	both() { grep -q rxe0 "$1" && grep -q rxe1 "$1"; }
	lists_both() {
		"$@" >/tmp/out 2>&1
		local rc=$?
		cat /tmp/out
		((rc == 0)) && both /tmp/out
	}
	step ibv_devices lists_both ibv_devices
	step ibv_devinfo lists_both ibv_devinfo
	step vmprobe lists_both "$bin/vmprobe"
	step go-test "$bin/vmtest.test" -test.v -test.count=1
	step perftest "$here/perftest.sh" -q ib_write_bw -s 65536 -n 500
	if ((${#failed[@]})); then
		echo "selftest: FAILED: ${failed[*]}"
		exit 1
	fi
	echo "selftest: all passed"
	exit 0
fi

repo=$(cd -- "$here/../.." && pwd -P)
bin=$repo/.cache/vm/bin
mkdir -p "$bin"
command -v go >/dev/null 2>&1 || export PATH=/usr/local/go/bin:$PATH
"$here/run.sh" --prepare # installs libibverbs-dev, which the cgo build needs
(cd "$repo" && go build -tags ibverbs -o "$bin/vmprobe" ./internal/ibv/vmprobe) ||
	{ echo "selftest: building internal/ibv/vmprobe failed" >&2; exit 1; }
(cd "$repo" && go test -c -o "$bin/vmtest.test" ./internal/vmtest) ||
	{ echo "selftest: building the internal/vmtest test binary failed" >&2; exit 1; }
exec "$here/run.sh" --timeout 300 "$@" -- "$here/selftest.sh" "$bin"
