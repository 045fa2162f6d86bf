#!/usr/bin/env bash
# scripts/scale.sh — start worlds of N ranks on this machine and print how
# long they take, one line per N.
#
#   scripts/scale.sh [N...]            default: 32 64 128 256 512
#
# Each rank is a process of examples/network under a launcher's
# environment (GOVERBS_RANK, GOVERBS_WORLD_SIZE, GOVERBS_ROOT: the
# rendezvous exchange of cluster.FromEnv) on soft0. Every rank joins, runs
# BARRIERS barriers, RDMA-writes one word to every other rank (unless
# WRITE=0) and exits. Columns:
#
#   N         world size
#   ok        ranks that finished without error
#   spawn     seconds to start the N processes (this script, serially)
#   startup   seconds from the first process' start to the last rank
#             connected (Join returned): the world's start-up time
#   barriers  longest time a rank spent in the barriers (the first one
#             includes connecting soft0 to its barrier peers)
#   a2a       longest time of the all-to-all write and the barrier after
#             it ("-" with WRITE=0)
#   wall      seconds until every process exited
#   cpu       CPU time of all the ranks together (user + system, s): the
#             work of the run, whatever else shares the machine
#   rss       largest peak resident set of a rank (MiB)
#   fds       most open descriptors seen in rank 0, N/2 and N-1
#   shm       most shared memory in use on the machine while the world ran
#             (MiB, Shmem of /proc/meminfo, less what was in use before):
#             soft0's shared-memory rings
#
# and, below a line that failed, the distinct error lines (ranks
# anonymised) with their counts.
#
# Environment: BARRIERS (default 100), WRITE (1), TIMEOUT (per rank, 300s),
# ALGORITHM (the barrier's, examples/network -algorithm: auto),
# TRANSPORT (GOVERBS_SOFT_TRANSPORT, shm), PORT (rank 0's exchange port,
# 19614), KEEP=1 keeps the per-rank output in $TMPDIR.
#
# It is not part of scripts/test.sh: 512 ranks take minutes on two CPUs.
# Run one at a time on a shared machine.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v go >/dev/null 2>&1 || export PATH=/usr/local/go/bin:$PATH

SIZES=("$@")
((${#SIZES[@]})) || SIZES=(32 64 128 256 512)
BARRIERS=${BARRIERS:-100}
WRITE=${WRITE:-1}
TIMEOUT=${TIMEOUT:-300s}
ALGORITHM=${ALGORITHM:-auto}
TRANSPORT=${TRANSPORT:-shm}
PORT=${PORT:-19614}

WORK=$(mktemp -d)
cleanup() {
	# Only the processes this script started.
	local pids
	pids=$(jobs -p)
	[[ -z $pids ]] || kill $pids 2>/dev/null || true
	[[ ${KEEP:-0} == 1 ]] && echo "output kept in $WORK" >&2 || rm -rf "$WORK"
}
trap cleanup EXIT
go build -o "$WORK/network" ./examples/network

now() { date +%s.%N; }

# fdcount PID: open descriptors of PID (0 when it is gone).
fdcount() { (ls "/proc/$1/fd" 2>/dev/null || true) | wc -l; }

# shmem: Shmem of /proc/meminfo (KiB).
shmem() { awk '/^Shmem:/ { print $2 }' /proc/meminfo; }

printf '%6s %9s %7s %8s %9s %7s %7s %7s %5s %6s %6s\n' N ok spawn startup barriers a2a wall cpu rss fds shm
for n in "${SIZES[@]}"; do
	dir="$WORK/$n"
	mkdir -p "$dir"
	write=()
	[[ $WRITE == 1 ]] || write=(-write=false)
	shm0=$(shmem)
	shm=0
	t0=$(now)
	pids=()
	for ((r = 0; r < n; r++)); do
		GOVERBS_RANK=$r GOVERBS_WORLD_SIZE=$n GOVERBS_ROOT=127.0.0.1:$PORT GOVERBS_TOKEN=scale \
			GOVERBS_JOB=scale-$n GOVERBS_SOFT_TRANSPORT=$TRANSPORT \
			/usr/bin/time -f 'maxrss %M cpu %U %S' -o "$dir/$r.rss" \
			${NETWORK:-$WORK/network} -launcher -barriers "$BARRIERS" -algorithm "$ALGORITHM" "${write[@]}" -timeout "$TIMEOUT" \
			>"$dir/$r.out" 2>&1 &
		pids+=($!)
	done
	t1=$(now)
	# Sample the descriptors of three ranks until every process exited.
	fds=0
	watch=("${pids[0]}" "${pids[n / 2]}" "${pids[n - 1]}")
	while kill -0 "${pids[@]}" 2>/dev/null; do
		for p in "${watch[@]}"; do
			# time(1) is the parent: count its child's descriptors.
			for c in $(cat "/proc/$p/task/$p/children" 2>/dev/null); do
				f=$(fdcount "$c")
				if ((f > fds)); then fds=$f; fi
			done
		done
		s=$(($(shmem) - shm0))
		if ((s > shm)); then shm=$s; fi
		sleep 1
	done
	wait || true
	t2=$(now)
	ok=$(cat "$dir"/*.out | grep -c ': ok$' || true)
	# maxdur PATTERN: the largest of the durations (Go's time.Duration
	# format: 1m2.5s, 812ms, 35µs) that follow PATTERN in the ranks'
	# output, in seconds; "-" if none.
	maxdur() {
		grep -ho "$1 [0-9.hmsµn]*" "$dir"/*.out 2>/dev/null | awk '
			{ d = $NF; v = 0
			  while (match(d, /^[0-9.]+(h|ms|µs|ns|m|s)/)) {
				num = substr(d, 1, RLENGTH); u = num; sub(/^[0-9.]+/, "", u); x = num + 0
				if (u == "h") x *= 3600; else if (u == "m") x *= 60; else if (u == "ms") x /= 1e3
				else if (u == "µs") x /= 1e6; else if (u == "ns") x /= 1e9
				v += x; d = substr(d, RLENGTH + 1)
			  }
			  if (v > m) m = v }
			END { if (NR) printf "%.2f", m; else printf "-" }'
	}
	# The ranks measure from their own start; rank 0 starts first and
	# waits for the last, so the largest "connected in" is the world's.
	startup=$(maxdur 'connected in')
	rss=$(awk '/maxrss/ { if ($2 > m) m = $2 } END { printf "%.0f", m / 1024 }' "$dir"/*.rss 2>/dev/null)
	cpu=$(awk '/maxrss/ { s += $4 + $5 } END { printf "%.1f", s }' "$dir"/*.rss 2>/dev/null)
	printf '%6s %9s %7.2f %8s %9s %7s %7.2f %7s %5s %6s %6s\n' "$n" "$ok/$n" "$(echo "$t1 - $t0" | bc)" "$startup" \
		"$(maxdur 'done in')" "$(maxdur 'all-to-all write in')" "$(echo "$t2 - $t0" | bc)" "$cpu" "$rss" "$fds" "$((shm / 1024))"
	if ((ok < n)); then
		grep -hv ': ok$\|connected in\|barriers (.*) done\|all-to-all write in\|launched by' "$dir"/*.out |
			sed 's/rank [0-9]*\/[0-9]*/rank R/g; s/rank [0-9][0-9]*/rank R/g; s/process [0-9]*/process P/g; s/pid=[0-9]*/pid=P/g' |
			sort | uniq -c | sort -rn | head -8 | sed 's/^/        /'
	fi
done
