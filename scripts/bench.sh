#!/usr/bin/env bash
# scripts/bench.sh — regenerate the README's benchmark tables: run each Go
# benchmark and its baseline in the same binary, alternately (the measured
# case, then its baseline, round after round), RUNS times, and print the
# medians and their ratios as markdown table rows ready to paste.
#
#   ./scripts/bench.sh inproc [RUNS]  in-process soft0 (root package):
#                                     SubmitPoll, WriteMsgRate, WriteBW vs Copy
#   ./scripts/bench.sh xproc [RUNS]   across processes (internal/soft): shared
#                                     memory, TCP and unix sockets vs copy(),
#                                     raw streams and raw ping-pongs (both
#                                     QPs in one process, the transport
#                                     forced; the bandwidth also with the
#                                     target and the raw reader in a child
#                                     process)
#   ./scripts/bench.sh tls [RUNS]     soft0 RDMA-write bandwidth over TCP,
#                                     encrypted (TLS) vs plain, 64 KiB and 1 MiB
#   ./scripts/bench.sh poll [RUNS]    channel's ways of waiting (package
#                                     channel, BenchmarkPollKV): a key-value
#                                     GET across processes, 1 and 8 clients
#   ./scripts/bench.sh session [RUNS] package session between processes vs
#                                     bare channels, RequestRemoteMR, WriteImm, the
#                                     allocator, the key-value example
#   ./scripts/bench.sh stream [RUNS]  package stream (net.Conn over a session)
#                                     between two processes vs kernel TCP
#                                     between the same two: 64 KiB Writes,
#                                     8-byte round trips
#   ./scripts/bench.sh pull [RUNS]    soft0 between two processes (goverbs bench):
#                                     payloads the target reads from the
#                                     sender's memory (the default) vs
#                                     copied through the ring or socket
#                                     (GOVERBS_SOFT_PULL=0); sends over shared
#                                     memory, writes, sends and reads over
#                                     unix sockets
#   ./scripts/bench.sh all [RUNS]     all of the above
#
# RUNS defaults to 5. Each package's test binary is built once; every
# round runs each case in its own process, the measured case right before
# its baseline. POLL_KINDS (default "shm unix tcp") and POLL_CLIENTS
# (default "1 8") narrow the poll target.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v go >/dev/null 2>&1 || export PATH=/usr/local/go/bin:$PATH

what=${1:-}
runs=${2:-5}
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT

# median reads numbers, one per line, and prints their median.
median() { sort -g | awk '{a[NR]=$1} END {if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }

# build NAME PKG builds the test binary of PKG once.
build() { [[ -x $bin/$1.test ]] || go test -c -o "$bin/$1.test" "$2"; }

# run NAME PATTERN [BENCHTIME] runs the benchmarks of binary NAME that
# PATTERN matches, once, with allocation counts, and prints their result
# lines.
run() {
	"$bin/$1.test" -test.run '^$' -test.bench "$2" -test.count 1 -test.benchmem ${3:+-test.benchtime "$3"} >"$bin/out" ||
		{ cat "$bin/out" >&2; exit 1; }
	grep -m1 '^cpu:' "$bin/out" >"$bin/cpu" || true
	grep '^Benchmark' "$bin/out" || { echo "bench.sh: no result for $2" >&2; exit 1; }
}

# rounds NAME ID PATTERN [ID PATTERN...] runs RUNS rounds; in each, every
# case in the order given (measured case, then its baseline). The result
# lines of case ID accumulate in $bin/ID.
rounds() {
	local name=$1
	shift
	local -a cases=("$@")
	for ((r = 0; r < runs; r++)); do
		for ((i = 0; i < ${#cases[@]}; i += 2)); do
			run "$name" "${cases[i + 1]}" >>"$bin/${cases[i]}"
		done
	done
}

# med ID UNIT [NAME] prints the median of the value before UNIT in the
# result lines of case ID (only the lines whose benchmark name contains
# NAME, if given).
med() {
	awk -v u="$2" -v n="${3:-}" 'n == "" || index($1, n) {for (i = 3; i <= NF; i++) if ($i == u) {print $(i-1); break}}' "$bin/$1" | median
}

# calc 'FORMAT, ARGS...' is printf in awk (floating point).
calc() { awk "BEGIN {printf $1}" ; }

header() {
	local cpu
	cpu=$(sed 's/^cpu: *//; s/ *$//' "$bin/cpu" 2>/dev/null || true)
	printf '\n`./scripts/bench.sh %s %d`: medians of %d runs, %s, %d CPUs (%s), %s\n\n' \
		"$1" "$runs" "$runs" "$(date -u +%Y-%m-%d)" "$(nproc)" "${cpu:-unknown CPU}" "$(go env GOVERSION)"
}

inproc() {
	build verbs .
	rounds verbs \
		submit '^BenchmarkSubmitPoll$' \
		rate1 '^BenchmarkWriteMsgRate$/^batch=1$' \
		rate16 '^BenchmarkWriteMsgRate$/^batch=16$' \
		rate64 '^BenchmarkWriteMsgRate$/^batch=64$' \
		bw64 '^BenchmarkWriteBW$/^size=64KiB$' \
		copy64 '^BenchmarkCopy$/^size=64KiB$' \
		bw1m '^BenchmarkWriteBW$/^size=1MiB$' \
		copy1m '^BenchmarkCopy$/^size=1MiB$'
	header inproc
	echo '| benchmark | result | allocs/op |'
	echo '| --- | --- | --- |'
	calc "\"| \`SubmitPoll\` (batch of 16 64-byte writes, last signaled, one Submit, Poll until its completion) | %.2f µs per batch (%.1f M writes/s) | %s |\n\", $(med submit ns/op)/1000, $(med submit Mmsg/s), $(med submit allocs/op)"
	local b
	for b in 1 16 64; do
		local label="\`WriteMsgRate/batch=$b\`"
		[[ $b == 1 ]] && label="$label (64-byte writes, 256 outstanding)"
		calc "\"| $label | %.1f ns/msg, %.2f Mmsg/s | %s |\n\", $(med rate$b ns/op), $(med rate$b Mmsg/s), $(med rate$b allocs/op)"
	done
	calc "\"| \`WriteBW/size=64KiB\` (RDMA write, batches of 16) | %.0f MB/s | %s |\n\", $(med bw64 MB/s), $(med bw64 allocs/op)"
	calc "\"| \`Copy/size=64KiB\` (\`copy()\` baseline, same binary) | %.0f MB/s | %s |\n\", $(med copy64 MB/s), $(med copy64 allocs/op)"
	calc "\"| \`WriteBW/size=1MiB\` | %.0f MB/s | %s |\n\", $(med bw1m MB/s), $(med bw1m allocs/op)"
	calc "\"| \`Copy/size=1MiB\` | %.0f MB/s | %s |\n\", $(med copy1m MB/s), $(med copy1m allocs/op)"
	calc "\"\nWriteBW / Copy: %.2f at 64 KiB, %.2f at 1 MiB\n\", $(med bw64 MB/s)/$(med copy64 MB/s), $(med bw1m MB/s)/$(med copy1m MB/s)"
}

# gib ID prints the median bandwidth of case ID in GiB/s (Go's MB/s is
# 10^6 bytes/s).
gib() { calc "\"%.2f\", $(med "$1" MB/s)*1e6/2^30"; }
# us ID prints the median ns/op of case ID in µs.
us() { calc "\"%.2f\", $(med "$1" ns/op)/1000"; }

xproc() {
	build soft ./internal/soft/
	local -a cases=(
		shmbw '^BenchmarkXprocWriteBandwidth$/^shm$/^size=1024KiB$'
		copy '^BenchmarkCopy$/^size=1024KiB$'
		shmpollbw '^BenchmarkXprocWriteBandwidthPolling$/^shm$/^size=1024KiB$'
		copy2 '^BenchmarkCopy$/^size=1024KiB$'
		shmspin '^BenchmarkXprocSendRTT$/^wait=spin$/^shm$'
		shmsleep '^BenchmarkXprocSendRTT$/^wait=sleep$/^shm$'
		unixpp '^BenchmarkRawPingPong$/^unix$'
	)
	local k
	for k in tcp unix; do
		cases+=(
			${k}bw64 "^BenchmarkXprocWriteBandwidth\$/^$k\$/^size=64KiB\$"
			${k}raw64 "^BenchmarkRawStream\$/^$k\$/^size=64KiB\$"
			${k}bw1m "^BenchmarkXprocWriteBandwidth\$/^$k\$/^size=1024KiB\$"
			${k}raw1m "^BenchmarkRawStream\$/^$k\$/^size=1024KiB\$"
			${k}spin "^BenchmarkXprocSendRTT\$/^wait=spin\$/^$k\$"
			${k}pp "^BenchmarkRawPingPong\$/^$k\$"
			${k}spinpp "^BenchmarkRawSpinPingPong\$/^$k\$"
			${k}sleep "^BenchmarkXprocSendRTT\$/^wait=sleep\$/^$k\$"
			${k}cbw64 "^BenchmarkChildWriteBandwidth\$/^$k\$/^size=64KiB\$"
			${k}craw64 "^BenchmarkChildRawStream\$/^$k\$/^size=64KiB\$"
			${k}cbw1m "^BenchmarkChildWriteBandwidth\$/^$k\$/^size=1024KiB\$"
			${k}craw1m "^BenchmarkChildRawStream\$/^$k\$/^size=1024KiB\$"
		)
	done
	rounds soft "${cases[@]}"
	header xproc
	echo '| transport | measure | soft0 | baseline | ratio | soft0 allocs/op |'
	echo '| --- | --- | --- | --- | --- | --- |'
	calc "\"| shared memory | RDMA write, 1 MiB | $(gib shmbw) GiB/s | \`copy()\` $(gib copy) GiB/s | %.2f | $(med shmbw allocs/op) |\n\", $(med shmbw MB/s)/$(med copy MB/s)"
	calc "\"| shared memory | same, the poster polling its CQ (as ib_write_bw) | $(gib shmpollbw) GiB/s | \`copy()\` $(gib copy2) GiB/s | %.2f | $(med shmpollbw allocs/op) |\n\", $(med shmpollbw MB/s)/$(med copy2 MB/s)"
	calc "\"| shared memory | 8-byte send round trip, polling | $(us shmspin) µs | unix socket ping-pong $(us unixpp) µs | %.2f | $(med shmspin allocs/op) |\n\", $(med shmspin ns/op)/$(med unixpp ns/op)"
	calc "\"| shared memory | same, sleeping in the completion channel | $(us shmsleep) µs | unix socket ping-pong $(us unixpp) µs | %.2f | $(med shmsleep allocs/op) |\n\", $(med shmsleep ns/op)/$(med unixpp ns/op)"
	local name
	for k in tcp unix; do
		name="TCP loopback" raw="raw Go TCP stream" pp="raw TCP ping-pong"
		[[ $k == unix ]] && name="unix socket" raw="raw Go unix stream" pp="raw unix ping-pong"
		calc "\"| $name | RDMA write, 64 KiB, 128 in flight | $(gib ${k}bw64) GiB/s | $raw $(gib ${k}raw64) GiB/s | %.2f | $(med ${k}bw64 allocs/op) |\n\", $(med ${k}bw64 MB/s)/$(med ${k}raw64 MB/s)"
		calc "\"| $name | RDMA write, 1 MiB | $(gib ${k}bw1m) GiB/s | $raw $(gib ${k}raw1m) GiB/s | %.2f | $(med ${k}bw1m allocs/op) |\n\", $(med ${k}bw1m MB/s)/$(med ${k}raw1m MB/s)"
		calc "\"| $name | 8-byte send round trip, polling | $(us ${k}spin) µs | $pp $(us ${k}pp) µs; $(us ${k}spinpp) µs spinning on non-blocking reads | %.2f; %.2f | $(med ${k}spin allocs/op) |\n\", $(med ${k}spin ns/op)/$(med ${k}pp ns/op), $(med ${k}spin ns/op)/$(med ${k}spinpp ns/op)"
		calc "\"| $name | same, sleeping | $(us ${k}sleep) µs | $pp $(us ${k}pp) µs | %.2f | $(med ${k}sleep allocs/op) |\n\", $(med ${k}sleep ns/op)/$(med ${k}pp ns/op)"
		calc "\"| $name | RDMA write into another process, 64 KiB, 128 in flight | $(gib ${k}cbw64) GiB/s | $raw read by another process $(gib ${k}craw64) GiB/s | %.2f | $(med ${k}cbw64 allocs/op) |\n\", $(med ${k}cbw64 MB/s)/$(med ${k}craw64 MB/s)"
		calc "\"| $name | RDMA write into another process, 1 MiB | $(gib ${k}cbw1m) GiB/s | $raw read by another process $(gib ${k}craw1m) GiB/s | %.2f | $(med ${k}cbw1m allocs/op) |\n\", $(med ${k}cbw1m MB/s)/$(med ${k}craw1m MB/s)"
	done
}

tls() {
	build soft ./internal/soft/
	rounds soft \
		plain64 '^BenchmarkXprocWriteBandwidth$/^tcp$/^size=64KiB$' \
		tls64 '^BenchmarkXprocWriteBandwidth$/^tls$/^size=64KiB$' \
		plain1m '^BenchmarkXprocWriteBandwidth$/^tcp$/^size=1024KiB$' \
		tls1m '^BenchmarkXprocWriteBandwidth$/^tls$/^size=1024KiB$'
	header tls
	echo '| RDMA write | plain TCP | TLS | TLS/plain |'
	echo '| --- | --- | --- | --- |'
	calc "\"| 64 KiB, 128 in flight | %.0f MB/s | %.0f MB/s | %.2f |\n\", $(med plain64 MB/s), $(med tls64 MB/s), $(med tls64 MB/s)/$(med plain64 MB/s)"
	calc "\"| 1 MiB | %.0f MB/s | %.0f MB/s | %.2f |\n\", $(med plain1m MB/s), $(med tls1m MB/s), $(med tls1m MB/s)/$(med plain1m MB/s)"
}

poll() {
	build channel ./channel/
	local k c
	local -a kinds=(${POLL_KINDS:-shm unix tcp}) clients=(${POLL_CLIENTS:-1 8})
	for ((r = 0; r < runs; r++)); do
		for k in "${kinds[@]}"; do
			for c in "${clients[@]}"; do
				# One process per case: the four ways of waiting, one
				# after the other. 5000 reads, 500 per client with 8.
				local n=5000
				((c > 1)) && n=$((500 * c))
				run channel "^BenchmarkPollKV\$/^$k\$/^clients=$c\$" "${n}x" >>"$bin/poll-$k-$c"
			done
		done
	done
	header poll
	echo '| transport | clients | measure | spin (`SpinAlways`) | sleep (`SpinNever`) | 64 polls (old default) | adaptive (default) | adaptive ÷ spin | adaptive ÷ sleep |'
	echo '| --- | --- | --- | --- | --- | --- | --- | --- | --- |'
	local m unit label
	for k in "${kinds[@]}"; do
		for c in "${clients[@]}"; do
			for m in p50 p99 mean cpu; do
				case $m in
				p50) unit=p50-ns label="p50 latency" ;;
				p99) unit=p99-ns label="p99 latency" ;;
				mean) unit=ns/op label="time per read" ;;
				cpu) unit=cpu-ns/op label="client CPU per read" ;;
				esac
				local -a v=()
				local w
				for w in spin sleep polls64 adaptive; do
					v+=("$(med "poll-$k-$c" "$unit" "wait=$w-")")
				done
				calc "\"| $k | $c | $label | %.1f µs | %.1f µs | %.1f µs | %.1f µs | %.2f | %.2f |\n\", ${v[0]}/1000, ${v[1]}/1000, ${v[2]}/1000, ${v[3]}/1000, ${v[3]}/${v[0]}, ${v[3]}/${v[1]}"
			done
		done
	done
	calc "\"\nallocations per read in the clients (adaptive, medians): %s\n\", \"$(for k in "${kinds[@]}"; do for c in "${clients[@]}"; do printf '%s/%s %s; ' "$k" "$c" "$(med "poll-$k-$c" client-allocs/op wait=adaptive-)"; done; done)\""
}

# session: package session between two processes (its benchmarks'
# child) against bare channels of the same transport, RequestRemoteMR
# against the round trip, the allocator against a sync.Pool, and the
# key-value example's GET (two dependent RDMA reads) against one read.
session() {
	build session ./session/
	local k
	local -a cases=(
		alloc '^BenchmarkAllocFree$/^size=64B$'
		pool '^BenchmarkAllocFree$/^baseline=sync.Pool$'
		serve '^BenchmarkServeRequest$'
	)
	for k in ${SESSION_KINDS:-shm unix tcp}; do
		cases+=(
			rtt-$k-s "^BenchmarkXprocRTT\$/^$k\$/^session\$"
			rtt-$k-c "^BenchmarkXprocRTT\$/^$k\$/^channel\$"
			bw-$k-s "^BenchmarkXprocBandwidth\$/^$k\$/^session\$"
			bw-$k-c "^BenchmarkXprocBandwidth\$/^$k\$/^channel\$"
			bw-$k-ci "^BenchmarkXprocBandwidth\$/^$k\$/^channel-imm\$"
			bw-$k-p "^BenchmarkXprocBandwidth\$/^$k\$/^session-posted\$"
			bw-$k-p16 "^BenchmarkXprocBandwidth\$/^$k\$/^session-posted-buffers=16\$"
			req-$k "^BenchmarkXprocRequest\$/^$k\$"
			reqspin-$k "^BenchmarkXprocRequestSpin\$/^$k\$"
			wimm-$k "^BenchmarkXprocWriteImm\$/^$k\$"
		)
	done
	local r i
	for ((r = 0; r < runs; r++)); do
		for ((i = 0; i < ${#cases[@]}; i += 2)); do
			local t=20000x
			[[ ${cases[i]} == req* ]] && t=2000x
			[[ ${cases[i]} == alloc || ${cases[i]} == pool || ${cases[i]} == serve ]] && t=
			run session "${cases[i + 1]}" $t >>"$bin/${cases[i]}"
		done
	done
	go build -o "$bin/kv" ./examples/kv
	for k in ${SESSION_KINDS:-shm unix tcp}; do
		for ((r = 0; r < runs; r++)); do
			GOVERBS_SOFT_TRANSPORT=$k "$bin/kv" -serve 127.0.0.1:0 -buckets 1024 -heap 1048576 >"$bin/kvsrv" 2>&1 &
			local pid=$! addr=
			for ((i = 0; i < 100; i++)); do
				[[ -n $addr ]] && break
				sleep 0.1
				addr=$(awk '/serving on/ {print $4}' "$bin/kvsrv")
			done
			GOVERBS_SOFT_TRANSPORT=$k "$bin/kv" -connect "$addr" -keys 1000 -n 20000 >>"$bin/kv-$k" || { kill $pid; exit 1; }
			kill $pid
			wait $pid 2>/dev/null || true
		done
	done
	header session
	echo '| transport | measure | session | baseline | ratio | goal | session allocs/op |'
	echo '| --- | --- | --- | --- | --- | --- | --- |'
	for k in ${SESSION_KINDS:-shm unix tcp}; do
		calc "\"| $k | 8-byte message round trip | $(us rtt-$k-s) µs | bare channel $(us rtt-$k-c) µs | %.2f | ≤ 1.15 | $(med rtt-$k-s allocs/op) |\n\", $(med rtt-$k-s ns/op)/$(med rtt-$k-c ns/op)"
		calc "\"| $k | 64 KiB messages | $(gib bw-$k-s) GiB/s | channel RDMA writes $(gib bw-$k-c) GiB/s | %.2f | ≥ 0.9 | $(med bw-$k-s allocs/op) |\n\", $(med bw-$k-s MB/s)/$(med bw-$k-c MB/s)"
		calc "\"| $k | 64 KiB messages, against channel RDMA writes with immediate data (each completes a receive, as a message does) | $(gib bw-$k-s) GiB/s | channel writes with immediate $(gib bw-$k-ci) GiB/s | %.2f | - | $(med bw-$k-s allocs/op) |\n\", $(med bw-$k-s MB/s)/$(med bw-$k-ci MB/s)"
		calc "\"| $k | 64 KiB messages, one poster (PostSendSlice, 16 in flight) | $(gib bw-$k-p) GiB/s | channel RDMA writes $(gib bw-$k-c) GiB/s | %.2f | ≥ 0.9 | $(med bw-$k-p allocs/op) |\n\", $(med bw-$k-p MB/s)/$(med bw-$k-c MB/s)"
		calc "\"| $k | same, 16 receive buffers (as many as in flight) | $(gib bw-$k-p16) GiB/s | channel RDMA writes $(gib bw-$k-c) GiB/s | %.2f | - | $(med bw-$k-p16 allocs/op) |\n\", $(med bw-$k-p16 MB/s)/$(med bw-$k-c MB/s)"
		calc "\"| $k | RequestRemoteMR 4 KiB in a loop, the default (its Release not timed) | %.2f µs | 2 × round trip + the agent's allocation $(calc "\"%.2f\", (2*$(med rtt-$k-s ns/op)+$(med serve ns/op))/1000") µs | %.2f | ≤ 1 | $(med req-$k allocs/op) (with Release) |\n\", $(med req-$k request-ns/op)/1000, $(med req-$k request-ns/op)/(2*$(med rtt-$k-s ns/op)+$(med serve ns/op))"
		calc "\"| $k | RequestRemoteMR 4 KiB, Config.AgentSpin on both sides | %.2f µs | 2 × round trip + the agent's allocation $(calc "\"%.2f\", (2*$(med rtt-$k-s ns/op)+$(med serve ns/op))/1000") µs | %.2f | ≤ 1 | $(med reqspin-$k allocs/op) (with Release) |\n\", $(med reqspin-$k request-ns/op)/1000, $(med reqspin-$k request-ns/op)/(2*$(med rtt-$k-s ns/op)+$(med serve ns/op))"
		calc "\"| $k | WriteImm 64 B (the write and its notice, one wait) | $(us wimm-$k) µs | 8-byte message round trip $(us rtt-$k-s) µs | %.2f | - | $(med wimm-$k allocs/op) |\n\", $(med wimm-$k ns/op)/$(med rtt-$k-s ns/op)"
		local get read
		get=$(awk '/get p50/ {print $8}' "$bin/kv-$k" | median)
		read=$(awk '/get p50/ {print $4}' "$bin/kv-$k" | median)
		calc "\"| $k | key-value GET (2 dependent reads), p50 | $get µs | one RDMA read $read µs | %.2f | ≤ 2.2 | |\n\", $get/$read"
	done
	calc "\"| - | the agent's allocation for a 4 KiB RequestRemoteMR and its release (BenchmarkServeRequest: Alloc, zero, register the window, the lease's timer; close, free) | %.2f µs | - | - | - | $(med serve allocs/op) |\n\", $(med serve ns/op)/1000"
	calc "\"| - | Alloc + Free, 64 B | %.1f ns | sync.Pool Get + Put %.1f ns | %.2f | ≤ 100 ns | $(med alloc allocs/op) |\n\", $(med alloc ns/op), $(med pool ns/op), $(med alloc ns/op)/$(med pool ns/op)"
}

# stream: package stream between two processes (its benchmark's child)
# over each soft0 transport, against kernel TCP between the same two
# processes (a net.Conn without goverbs), alternately.
stream() {
	build stream ./stream/
	local k
	local -a cases=()
	for k in shm unix tcp; do
		cases+=(
			w-$k "^BenchmarkXprocStream\$/^write64k\$/^$k\$"
			w-kernel-$k '^BenchmarkXprocStream$/^write64k$/^kernel$'
			r-$k "^BenchmarkXprocStream\$/^rtt8\$/^$k\$"
			r-kernel-$k '^BenchmarkXprocStream$/^rtt8$/^kernel$'
		)
	done
	local r i
	for ((r = 0; r < runs; r++)); do
		for ((i = 0; i < ${#cases[@]}; i += 2)); do
			run stream "${cases[i + 1]}" 20000x >>"$bin/${cases[i]}"
		done
	done
	header stream
	echo '| transport | measure | stream | kernel TCP (same run) | ratio | stream allocs/op |'
	echo '| --- | --- | --- | --- | --- | --- |'
	for k in shm unix tcp; do
		calc "\"| $k | 64 KiB Writes | $(gib w-$k) GiB/s | $(gib w-kernel-$k) GiB/s | %.2f | $(med w-$k allocs/op) |\n\", $(med w-$k MB/s)/$(med w-kernel-$k MB/s)"
		calc "\"| $k | 8-byte round trip | $(us r-$k) µs | $(us r-kernel-$k) µs | %.2f | $(med r-$k allocs/op) |\n\", $(med r-$k ns/op)/$(med r-kernel-$k ns/op)"
	done
}

# pull: goverbs bench between two processes of this host, with pulled
# payloads (the default, internal/soft/cma.go) and without
# (GOVERBS_SOFT_PULL=0 in both), alternately, 2 GB per run: sends over shared memory (its RDMA
# writes and reads are direct copies either way), writes, sends and
# reads over unix sockets.
pull() {
	go build -o "$bin/goverbs" ./cmd/goverbs
	local -a cases=("shm send" "unix write" "unix send" "unix read")
	local r c s p port=18700
	for ((r = 0; r < runs; r++)); do
		for c in "${cases[@]}"; do
			local tr=${c% *} op=${c#* }
			for s in 65536 1048576; do
				for p in 1 0; do
					port=$((port + 1))
					GOVERBS_SOFT_PULL=$p GOVERBS_SOFT_TRANSPORT=$tr "$bin/goverbs" bench $op --server -p $port -s $s -n $((2000000000 / s)) >/dev/null 2>&1 &
					local pid=$! i
					for ((i = 0; i < 50; i++)); do
						GOVERBS_SOFT_PULL=$p GOVERBS_SOFT_TRANSPORT=$tr "$bin/goverbs" bench $op -s $s -n $((2000000000 / s)) -p $port 127.0.0.1 >"$bin/out" 2>/dev/null && break
						sleep 0.1
					done
					wait $pid || true
					awk '/BW average/ {getline; print $4}' "$bin/out" >>"$bin/pull-$tr-$op-$s-$p"
				done
			done
		done
	done
	sed -n 's/^model name\t*: */cpu: /p' /proc/cpuinfo | head -1 >"$bin/cpu"
	header pull
	echo '| transport | operation | message | pulled (the default) | copied (GOVERBS_SOFT_PULL=0) | ratio |'
	echo '| --- | --- | --- | --- | --- | --- |'
	for c in "${cases[@]}"; do
		local tr=${c% *} op=${c#* }
		for s in 65536 1048576; do
			local f=$bin/pull-$tr-$op-$s
			calc "\"| $tr | $op | $((s >> 10)) KiB | %.0f MB/s | %.0f MB/s | %.2f |\n\", $(median <"$f-1"), $(median <"$f-0"), $(median <"$f-1")/$(median <"$f-0")"
		done
	done
}

case "$what" in
inproc | xproc | tls | poll | session | stream | pull) "$what" ;;
all)
	inproc
	xproc
	tls
	poll
	session
	stream
	pull
	;;
*)
	echo "usage: $0 inproc|xproc|tls|poll|session|stream|pull|all [RUNS]" >&2
	exit 2
	;;
esac
