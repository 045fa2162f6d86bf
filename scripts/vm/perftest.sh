#!/usr/bin/env bash
# scripts/vm/perftest.sh — run perftest pairs (server on rxe0, client on rxe1)
# inside the SoftRoCE VM of scripts/vm/run.sh and print their output.
#
# Usage:
#   scripts/vm/perftest.sh [-q] [RUN_OPTIONS --] TEST [ARGS...] [+ TEST [ARGS...]]...
#
#   TEST is a perftest program (ib_write_bw, ib_write_lat, ib_send_lat,
#   ib_send_bw, ib_read_bw, ib_read_lat, ib_atomic_bw, ...). ARGS go to both
#   server and client; the script adds `-d rxe0 -x 0 -p PORT` for the server
#   and `-d rxe1 -x 0 -p PORT 127.0.0.1` for the client (out-of-band exchange
#   over loopback, RoCE v2 link-local GID 0). Several tests separated by a
#   lone `+` run one after another in the same VM boot. RUN_OPTIONS are
#   scripts/vm/run.sh options (e.g. --timeout 300 --mtu 4200) and must end
#   with `--`.
#
#   For each test the client's output is printed under "== TEST ARGS (client)"
#   and the server's under "== TEST ARGS (server)"; with -q (or
#   GOVERBS_PERFTEST_QUIET=1) only the client's results table is printed
#   (full output still for a failed test). The exit status is non-zero when
#   any test failed.
#
# Examples:
#   scripts/vm/perftest.sh ib_write_bw -s 65536
#   scripts/vm/perftest.sh ib_write_bw -s 65536 + ib_write_lat + ib_send_lat -s 2
#   scripts/vm/perftest.sh --timeout 900 -- ib_send_lat -a
#
# Each process is also bounded in the guest by $GOVERBS_PERFTEST_TIMEOUT
# seconds (default 180).

set -euo pipefail

self=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)/$(basename -- "${BASH_SOURCE[0]}")

if [[ ${1:-} == -q ]]; then
	export GOVERBS_PERFTEST_QUIET=1
	shift
fi

if [[ ${GOVERBS_VM:-} != 1 ]]; then
	# On the host: boot the VM and run this script inside it.
	run_opts=()
	for a in "$@"; do
		if [[ $a == -- ]]; then
			while [[ $1 != -- ]]; do run_opts+=("$1"); shift; done
			shift
			break
		fi
	done
	(($#)) || { sed -n '2,/^$/{s/^# \{0,1\}//;p}' "$self" >&2; exit 2; }
	exec "$(dirname -- "$self")/run.sh" "${run_opts[@]+"${run_opts[@]}"}" -- "$self" "$@"
fi

# In the guest.
limit=${GOVERBS_PERFTEST_TIMEOUT:-180}
work=$(mktemp -d)
port=18515
failed=0

run_pair() {
	local test=$1
	shift
	local name="$test${*:+ $*}"
	command -v "$test" >/dev/null || { echo "== $name: $test not found (perftest installed?)"; return 1; }
	port=$((port + 1))
	timeout "$limit" "$test" -d rxe0 -x 0 -p "$port" "$@" >"$work/server" 2>&1 &
	local spid=$! crc=1
	for _ in $(seq 1 30); do
		sleep 0.5
		if ! kill -0 "$spid" 2>/dev/null; then
			break # server died: report below
		fi
		if timeout "$limit" "$test" -d rxe1 -x 0 -p "$port" "$@" 127.0.0.1 >"$work/client" 2>&1; then
			crc=0
			break
		fi
		crc=$?
		# Retry only while the server is not listening yet.
		grep -q "Couldn't connect to 127.0.0.1" "$work/client" || break
	done
	local src=0
	wait "$spid" || src=$?
	# perftest's closing handshake over the socket occasionally fails on the
	# server after both sides have measured and printed their results (seen
	# once under heavy host load): the client's numbers stand, with a warning.
	if ((crc == 0 && src != 0 && src != 124)) && grep -q '#bytes' "$work/server"; then
		echo "== $name: warning: server exited $src after its report:"
		grep -v '^[[:space:]]*$' "$work/server" | tail -n 3 | sed 's/^/   server: /'
		src=0
	fi
	if [[ ${GOVERBS_PERFTEST_QUIET:-} == 1 ]] && ((crc == 0 && src == 0)); then
		echo "== $name"
		awk '/#bytes/ { on = 1 } on && /^-+$/ { exit } on' "$work/client"
		return 0
	fi
	local to=" (timed out after ${limit}s: GOVERBS_PERFTEST_TIMEOUT)"
	echo "== $name (client, exit $crc$( ((crc == 124)) && echo "$to"))"
	cat "$work/client" 2>/dev/null || true
	echo "== $name (server, exit $src$( ((src == 124)) && echo "$to"))"
	cat "$work/server"
	((crc == 0 && src == 0))
}

args=()
while (($#)); do
	if [[ $1 == + ]]; then
		((${#args[@]})) && { run_pair "${args[@]}" || failed=1; }
		args=()
	else
		args+=("$1")
	fi
	shift
done
((${#args[@]})) && { run_pair "${args[@]}" || failed=1; }
rm -rf "$work"
exit "$failed"
