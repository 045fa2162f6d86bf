#!/usr/bin/env bash
# scripts/vm/compare.sh — goverbs bench against C perftest on the same
# SoftRoCE devices, in one boot of the VM of scripts/vm/run.sh.
#
# Usage:
#   scripts/vm/compare.sh [-r N] [-q] [RUN_OPTIONS --]
#
#   Builds cmd/goverbs with -tags ibverbs on the host, boots the VM once and
#   runs, for every case below, the perftest pair and the goverbs pair with
#   the same parameters and topology: server on rxe0 pinned to vCPU 0,
#   client on rxe1 pinned to vCPU 1 (taskset), out-of-band exchange over
#   127.0.0.1, RoCE v2 GID 0. Each pair runs N times (-r, default 5),
#   perftest and goverbs alternating, and the table shows the median of
#   each and their ratio goverbs/perftest:
#
#     write bw 64K        ib_write_bw -s 65536      goverbs bench write -s 65536 --batch 1 --cq-mod 100
#     write lat 2,16,64 B ib_write_lat -s S         goverbs bench write --lat -s S
#     send lat 2,16,64 B  ib_send_lat -s S          goverbs bench send --lat -s S
#     write msg rate 64 B ib_write_bw -s 64 -l 16 -Q 16   goverbs bench write -s 64 --batch 16 --cq-mod 16
#
#   goverbs sends inline as much as perftest reports it did ("Max inline
#   data" in perftest's header becomes goverbs' -I), so both tools post the
#   same requests.
#   (perftest's defaults elsewhere: -t 128; bandwidth -n 5000, except the
#   message rate -n 20000; latency -n 2000.) Bandwidth and message rate
#   compare BW average and MsgRate (higher is better; target ratio >= 0.95),
#   latency compares t_typical, the median of half round trips (lower is
#   better; target <= 1.05), and t_avg for information. "ratio" is the
#   ratio of the two medians; "paired" (which the target is checked on) is
#   the median over the runs of goverbs run i / perftest run i, which ran
#   back to back: the host's load drifts, and a pair shares it.
#
#   Below the table it prints the cost of one cgo crossing in the same
#   guest, hot and right after kernel work (internal/ibv's
#   BenchmarkCgoCrossing): the unit of what goverbs adds to a message
#   ("cgo calls per message" in the rows), which TCG inflates far beyond
#   what it costs on hardware (tens of nanoseconds).
#
#   -r N   repetitions of each pair (median reported)
#   -q     print only the table (not every run's row)
#   RUN_OPTIONS are scripts/vm/run.sh options and must end with `--`.
#
# The raw rows of every run are printed before the table (unless -q). Under
# TCG everything is slow and noisy (see run.sh): compare the ratios, which
# are measured in the same boot, not the absolute numbers.

set -euo pipefail

self=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)/$(basename -- "${BASH_SOURCE[0]}")
repo=$(cd -- "$(dirname -- "$self")/../.." && pwd -P)

reps=${GOVERBS_COMPARE_REPS:-5}
quiet=${GOVERBS_COMPARE_QUIET:-0}
while (($#)); do
	case $1 in
	-r) reps=$2; shift 2 ;;
	-q) quiet=1; shift ;;
	-h | --help) sed -n '2,/^$/{s/^# \{0,1\}//;p}' "$self"; exit 0 ;;
	*) break ;;
	esac
done
[[ $reps =~ ^[1-9][0-9]*$ ]] || { echo "compare: -r wants a positive number, not '$reps'" >&2; exit 2; }

if [[ ${GOVERBS_VM:-} != 1 ]]; then
	# On the host: build goverbs where the guest can see it, boot, run this
	# script inside.
	run_opts=()
	if (($#)); then
		while (($#)) && [[ $1 != -- ]]; do run_opts+=("$1"); shift; done
		(($#)) || { echo "compare: run.sh options must end with --" >&2; exit 2; }
		shift
	fi
	(($# == 0)) || { echo "compare: unexpected arguments: $*" >&2; exit 2; }
	bindir=$repo/.cache/vm/bin
	case $repo in
	/tmp/* | /var/tmp/* | /run/* | /dev/shm/*) bindir=${GOVERBS_VM_CACHE:-/var/cache/goverbs-vm}/bin ;;
	esac
	mkdir -p "$bindir"
	export PATH=$PATH:/usr/local/go/bin
	(cd "$repo" && go build -tags ibverbs -o "$bindir/goverbs" ./cmd/goverbs) || { echo "compare: building goverbs failed" >&2; exit 1; }
	(cd "$repo" && go test -c -tags ibverbs -o "$bindir/ibv.test" ./internal/ibv) || { echo "compare: building the internal/ibv test binary failed" >&2; exit 1; }
	exec "$(dirname -- "$self")/run.sh" --timeout "${GOVERBS_COMPARE_TIMEOUT:-1800}" "${run_opts[@]+"${run_opts[@]}"}" \
		--env GOVERBS_COMPARE_BIN="$bindir/goverbs" --env GOVERBS_COMPARE_IBVTEST="$bindir/ibv.test" \
		--env GOVERBS_COMPARE_REPS="$reps" --env GOVERBS_COMPARE_QUIET="$quiet" \
		-- "$self"
fi

# ---------------------------------------------------------------- guest --

gv=${GOVERBS_COMPARE_BIN:?}
limit=${GOVERBS_PERFTEST_TIMEOUT:-300}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
port=18600
failed=0
# Server and client each on their own vCPU, for both tools alike: unpinned,
# a process that migrates while it posts makes rxe send a QP's packets from
# two CPUs' backlogs, out of order, which costs NAKs and retransmissions.
cpu_srv=0 cpu_cli=1
if (($(nproc) < 2)); then cpu_cli=0; fi

# row FILE: the first result row of a perftest-style table (after #bytes).
row() { awk '/#bytes/ { on = 1; next } on && NF >= 5 && $1 ~ /^[0-9]+$/ { print; exit }' "$1"; }

# pair NAME SERVER_CMD... -- CLIENT_CMD...: runs one server/client pair,
# prints the client's result row (or nothing, after the outputs, on failure).
pair() {
	local name=$1
	shift
	local srv=() cli=()
	while [[ $1 != -- ]]; do srv+=("$1"); shift; done
	shift
	cli=("$@")
	port=$((port + 1))
	timeout "$limit" taskset -c "$cpu_srv" "${srv[@]}" -p "$port" >"$work/server" 2>&1 &
	local spid=$! crc=1
	for _ in $(seq 1 40); do
		sleep 0.25
		kill -0 "$spid" 2>/dev/null || break
		if timeout "$limit" taskset -c "$cpu_cli" "${cli[@]}" -p "$port" 127.0.0.1 >"$work/client" 2>&1; then
			crc=0
			break
		fi
		crc=$?
		grep -q "Couldn't connect to 127.0.0.1" "$work/client" || break
	done
	local src=0
	wait "$spid" || src=$?
	local r
	r=$(row "$work/client")
	# perftest's closing handshake sometimes fails on the server after both
	# sides reported (see perftest.sh): the client's numbers stand.
	if ((crc == 0)) && [[ -n $r ]]; then
		((src == 0)) || echo "   ($name: server exited $src after the run)" >&2
		echo "$r"
		if [[ $quiet != 1 ]] && grep -q '^ cgo calls' "$work/client"; then
			grep '^ cgo calls' "$work/client" | sed 's/^ */   /' >&2
		fi
		return 0
	fi
	{
		echo "== $name: client exit $crc, server exit $src"
		echo "-- client: ${cli[*]}"
		cat "$work/client"
		echo "-- server: ${srv[*]}"
		cat "$work/server"
	} >&2
	return 1
}

# median of the numbers on stdin.
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print "nan"; else if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

results=$work/results # lines: case|metric|kind|perftest|goverbs
: >"$results"

# run_case LABEL KIND PERFTEST_TEST PERFTEST_ARGS -- GOVERBS_ARGS
#   KIND: bw (columns BW average, MsgRate) or lat (t_typical, t_avg).
run_case() {
	local label=$1 kind=$2 ptest=$3
	shift 3
	local pargs=() gargs=()
	while [[ $1 != -- ]]; do pargs+=("$1"); shift; done
	shift
	gargs=("$@")
	local i p g inl
	local -a pv=() gvv=() gi=()
	for ((i = 1; i <= reps; i++)); do
		if p=$(pair "$ptest ${pargs[*]}" "$ptest" -d rxe0 -x 0 "${pargs[@]}" -- "$ptest" -d rxe1 -x 0 "${pargs[@]}"); then
			pv+=("$p")
			[[ $quiet == 1 ]] || printf '%-22s perftest #%d: %s\n' "$label" "$i" "$p" >&2
			# Send inline exactly as much as perftest did ("Max inline
			# data: N[B]" in its header), so both post the same requests.
			inl=$(sed -n 's/.*Max inline data *: *\([0-9][0-9]*\).*/\1/p' "$work/client" | head -n 1)
			if [[ -n $inl && ${#gi[@]} -eq 0 ]]; then
				gi=(-I "$inl")
				[[ $quiet == 1 ]] || echo "   ($label: perftest sends up to $inl B inline; goverbs gets -I $inl)" >&2
			fi
		else
			failed=1
		fi
		if g=$(pair "goverbs ${gargs[*]} ${gi[*]}" "$gv" bench "${gargs[@]}" "${gi[@]+"${gi[@]}"}" -d rxe0 --server -- "$gv" bench "${gargs[@]}" "${gi[@]+"${gi[@]}"}" -d rxe1); then
			gvv+=("$g")
			[[ $quiet == 1 ]] || printf '%-22s goverbs  #%d: %s\n' "$label" "$i" "$g" >&2
		else
			failed=1
		fi
	done
	local c1 c2 m1 m2
	if [[ $kind == bw ]]; then
		c1=4 c2=5 m1="BW avg [MB/s]" m2="MsgRate [Mpps]"
	else
		c1=5 c2=6 m1="t_typical [us]" m2="t_avg [us]"
	fi
	local pm gm pr
	for c in "$c1:$m1" "$c2:$m2"; do
		local col=${c%%:*} metric=${c#*:}
		pm=$(printf '%s\n' "${pv[@]+"${pv[@]}"}" | awk -v c="$col" 'NF { print $c }' | median)
		gm=$(printf '%s\n' "${gvv[@]+"${gvv[@]}"}" | awk -v c="$col" 'NF { print $c }' | median)
		# Paired ratios: run i of goverbs over run i of perftest, which ran
		# just before it (the host's load drifts slowly; pairs share it).
		pr=nan
		if ((${#pv[@]} == ${#gvv[@]} && ${#pv[@]} > 0)); then
			# (No process substitution: the guest has no /dev/fd.)
			printf '%s\n' "${pv[@]}" | awk -v c="$col" '{ print $c }' >"$work/p"
			printf '%s\n' "${gvv[@]}" | awk -v c="$col" '{ print $c }' >"$work/g"
			pr=$(paste "$work/p" "$work/g" | awk '$1 + 0 > 0 { print $2 / $1 }' | median)
		fi
		echo "$label|$metric|$kind|$pm|$gm|$pr" >>"$results"
	done
}

echo "goverbs vs perftest on rxe0 (server) <-> rxe1 (client), $reps run(s) each, medians; $(uname -r), $(nproc) vCPUs" >&2

# Baseline: the cost of one cgo crossing in this guest (internal/ibv's
# BenchmarkCgoCrossing, on the client's vCPU), hot and right after a system
# call that did kernel work, as every Submit's doorbell does on rxe. goverbs
# crosses into C once per Submit and once per Poll ("cgo calls per message"
# in the rows); perftest calls libibverbs directly.
cgo_hot=? cgo_cold=?
if [[ -x ${GOVERBS_COMPARE_IBVTEST:-} ]]; then
	taskset -c "$cpu_cli" "$GOVERBS_COMPARE_IBVTEST" -test.run '^$' -test.bench '^BenchmarkCgoCrossing$' -test.benchtime 20000x >"$work/cgo" 2>&1 || true
	cgo_hot=$(awk '/CgoCrossing\/hot/ { for (i = 1; i < NF; i++) if ($(i + 1) == "ns/op") printf "%.3f", $i / 1000 }' "$work/cgo")
	cgo_cold=$(awk '/CgoCrossing\/after-syscall/ { for (i = 1; i < NF; i++) if ($(i + 1) == "ns/crossing") printf "%.3f", $i / 1000 }' "$work/cgo")
	[[ -n $cgo_hot && -n $cgo_cold ]] || { cgo_hot=? cgo_cold=?; cat "$work/cgo" >&2; }
fi

run_case "write bw 64K" bw ib_write_bw -s 65536 -n 5000 -- write -s 65536 -n 5000 --batch 1 --cq-mod 100
for s in 2 16 64; do
	run_case "write lat ${s}B" lat ib_write_lat -s "$s" -n 2000 -- write --lat -s "$s" -n 2000
done
for s in 2 16 64; do
	run_case "send lat ${s}B" lat ib_send_lat -s "$s" -n 2000 -- send --lat -s "$s" -n 2000
done
run_case "write rate 64B x16" bw ib_write_bw -s 64 -n 20000 -l 16 -Q 16 -- write -s 64 -n 20000 --batch 16 --cq-mod 16

echo
printf '%-20s %-16s %12s %12s %8s %8s %s\n' "case" "metric" "perftest" "goverbs" "ratio" "paired" "target (on paired)"
printf '%s\n' "-----------------------------------------------------------------------------------------------"
while IFS='|' read -r label metric kind pm gm pr; do
	# A failed run leaves "nan" or nothing: that ratio is unknown ("?"),
	# never a pass.
	mratio=$(awk -v p="$pm" -v g="$gm" 'BEGIN { num = "^[0-9]*[.]?[0-9]+([eE][-+]?[0-9]+)?$"; if (p ~ num && g ~ num && p + 0 > 0) printf "%.3f", g / p; else print "n/a" }')
	ratio=$(awk -v r="$pr" 'BEGIN { num = "^[0-9]*[.]?[0-9]+([eE][-+]?[0-9]+)?$"; if (r ~ num) printf "%.3f", r; else print "n/a" }')
	target="" verdict=""
	case $metric in
	"BW avg"* | "MsgRate"*)
		if [[ $label == *rate* && $metric == MsgRate* ]] || [[ $label == *"bw"* && $metric == "BW avg"* ]]; then
			target=">= 0.95"
			verdict=$(awk -v r="$ratio" 'BEGIN { if (r == "n/a") print "?"; else print (r >= 0.95 ? "ok" : "MISS") }')
		fi
		;;
	"t_typical"*)
		target="<= 1.05"
		verdict=$(awk -v r="$ratio" 'BEGIN { if (r == "n/a") print "?"; else print (r <= 1.05 ? "ok" : "MISS") }')
		;;
	esac
	printf '%-20s %-16s %12s %12s %8s %8s %s\n' "$label" "$metric" "$pm" "$gm" "$mratio" "$ratio" "${target:+$target $verdict}"
done <"$results"
echo
echo "one cgo crossing in this guest: ${cgo_hot} us hot, ${cgo_cold} us right after kernel work (BenchmarkCgoCrossing)"
exit "$failed"
