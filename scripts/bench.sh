#!/usr/bin/env bash
# scripts/bench.sh — reproduce a README benchmark figure: run a Go
# benchmark and its baseline in the same binary, alternately, several
# times, and print the median of each and their ratio.
#
#   ./scripts/bench.sh tls [RUNS]   soft0 RDMA-write bandwidth over TCP,
#                                   encrypted (TLS) vs plain, 64 KiB and 1 MiB
#
# RUNS defaults to 5. Every run builds nothing new: the test binary is
# built once and each round runs the measured case and its baseline back
# to back.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v go >/dev/null 2>&1 || export PATH=/usr/local/go/bin:$PATH

what=${1:-}
runs=${2:-5}
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT

# median reads numbers, one per line, and prints their median.
median() { sort -g | awk '{a[NR]=$1} END {if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }

case "$what" in
tls)
	go test -c -o "$bin/soft.test" ./internal/soft/
	for size in 64 1024; do
		: >"$bin/plain"
		: >"$bin/tls"
		for ((i = 0; i < runs; i++)); do
			for kind in tcp tls; do
				f=plain
				[[ $kind == tls ]] && f=tls
				"$bin/soft.test" -test.run '^$' -test.bench "XprocWriteBandwidth/$kind/size=${size}KiB\$" -test.count 1 |
					awk '/^Benchmark/ {for (i = 1; i <= NF; i++) if ($(i+1) == "MB/s") print $i}' >>"$bin/$f"
			done
		done
		p=$(median <"$bin/plain")
		t=$(median <"$bin/tls")
		awk -v s="$size" -v p="$p" -v t="$t" -v n="$runs" 'BEGIN {
			printf "RDMA write %4d KiB over TCP, medians of %d runs: plain %.0f MB/s, TLS %.0f MB/s, TLS/plain %.2f\n", s, n, p, t, t / p }'
	done
	;;
*)
	echo "usage: $0 tls [RUNS]" >&2
	exit 2
	;;
esac
