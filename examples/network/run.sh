#!/usr/bin/env bash
# run.sh — run N ranks of the network example on this machine, each in its
# own process, over loopback.
#
#   examples/network/run.sh [N] [extra flags for every rank...]
#
# It builds the program, writes a configuration of N ranks on 127.0.0.1
# (ports from ${PORT:-18515}), starts every rank, waits for all of them and
# exits non-zero if any failed. Every rank's output is printed, prefixed
# with its rank.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
command -v go >/dev/null 2>&1 || export PATH=/usr/local/go/bin:$PATH

n=${1:-4}
shift || true
port=${PORT:-18515}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

go build -o "$dir/network" ./examples/network
{
	echo '{"hosts": ['
	for ((r = 0; r < n; r++)); do
		sep=,
		((r == n - 1)) && sep=
		echo "  {\"hostname\": \"127.0.0.1\", \"port\": $((port + r)), \"device\": \"soft0\", \"rank\": $r}$sep"
	done
	echo ']}'
} >"$dir/net.json"

pids=()
for ((r = 0; r < n; r++)); do
	"$dir/network" -config "$dir/net.json" -rank "$r" "$@" > >(sed "s/^/[$r] /") 2>&1 &
	pids+=($!)
done
status=0
for ((r = 0; r < n; r++)); do
	if ! wait "${pids[$r]}"; then
		echo "rank $r failed" >&2
		status=1
	fi
done
exit $status
