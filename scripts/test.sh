#!/usr/bin/env bash
# scripts/test.sh — THE test command of the project (CI runs it via .ci/run).
#
#   1. scripts/deps.sh   install what is missing (idempotent)
#   2. scripts/lint.sh   static checks; any failure stops here
#   3. the test tiers, in order; each prints
#        tier NAME: N passed, N failed, N skipped
#      with every skipped test and its reason, and tiers not run print
#        tier NAME: not run (REASON)
#   4. one closing line, the sum over all tiers, read by CI:
#        N passed, N failed, N skipped
#
# Exit status: non-zero if lint, a build, a test or a package failed.
#
# Adding a tier: define a function tier_NAME that runs its tests through
# run_go_tests (or feeds `go test -json` into the summarizer itself), add
# NAME to ALL_TIERS, and to TIERS once it should run by default. Override the
# tier list with GOVERBS_TIERS="unit multiprocess" ./scripts/test.sh.
#
# How tests are counted (see internal/tools/testsummary): every test and
# every subtest counts once; a failing subtest also fails its parent; a test
# that never reported a result (panic elsewhere, timeout) counts as failed.
set -euo pipefail

# Tiers that run, in order.
TIERS="${GOVERBS_TIERS:-unit multiprocess vm}"
# Every tier the project knows, in order; those not in TIERS are reported as
# not run, with the reason below.
ALL_TIERS="unit multiprocess vm"
declare -A NOT_RUN_REASON=()

# Timeout of each test binary (go test -timeout). CI allows 90 minutes in all.
GO_TEST_TIMEOUT="${GO_TEST_TIMEOUT:-20m}"

cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v go >/dev/null 2>&1 || export PATH=/usr/local/go/bin:$PATH

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
COUNTS="$WORK/counts" # one line per tier run: NAME PASSED FAILED SKIPPED PKGFAILS
SUMMARY="$WORK/testsummary"
FAILED="$WORK/failed" # one line per failed test or package: TIER: PACKAGE TEST
: >"$COUNTS"
: >"$FAILED"

# run_go_tests TIER [go test args...] — run `go test -race -count=1 -json`
# with the given arguments and summarize it as tier TIER.
run_go_tests() {
	local tier=$1
	shift
	local go_rc sum_rc
	echo "==== tier $tier: go test -race -count=1 -timeout $GO_TEST_TIMEOUT $*"
	# stderr is merged: go's own errors (bad go.mod, ...) are echoed unchanged.
	set +e
	go test -race -count=1 -json -timeout "$GO_TEST_TIMEOUT" "$@" 2>&1 |
		"$SUMMARY" -tier "$tier" -counts "$COUNTS" -failed "$FAILED"
	go_rc=${PIPESTATUS[0]} sum_rc=${PIPESTATUS[1]}
	set -e
	# The summarizer knows about failed tests and packages; go test's own
	# status also catches what it could not see.
	if ((go_rc != 0 && sum_rc == 0)); then
		echo "tier $tier: go test exited with status $go_rc (see output above)"
		# Record it so that the closing line cannot read as a clean run.
		echo "$tier-go-test 0 0 0 1" >>"$COUNTS"
		return 1
	fi
	((sum_rc == 0))
}

# ---- tiers -------------------------------------------------------------------

# Tier 1: unit tests of every package, under the race detector. The
# cross-process tests (every test named *CrossProcess*) run in tier 2.
tier_unit() {
	run_go_tests unit -skip "CrossProcess" ./...
}

# Tier 2: several OS processes on loopback. The cross-process conformance
# cases and fault tests of soft0 (verbstest: the test binary re-executes
# itself as the peer process) over TCP, unix sockets and shared memory,
# cluster's Shares between processes, a peer that exits right after a
# message or a write lands (TestExitAtOnceCrossProcess), the
# session package's (async-rdma's scenarios, faults and reconnects between
# processes, over every transport) and the stream package's (an echo and
# a writer that closes at once, in a child process, over every
# transport), the collective package's (worlds of
# 2 to 8 rank processes over every transport running the collectives,
# ranks killed and stopped mid-allreduce), then,
# per inter-process transport of soft0 (GOVERBS_SOFT_TRANSPORT), the whole
# conformance suite twice: with both QPs in one process and every connection
# forced through the transport (TestConformanceSoft), and with side B of
# every case in a peer process (TestConformanceSoftCrossProcess). The
# run tls is TCP encrypted as between hosts (GOVERBS_SOFT_TLS=on); the
# last two run the cross-process half over unix sockets and shared memory
# with large payloads copied, not pulled (GOVERBS_SOFT_PULL=0,
# internal/soft/cma.go; pulled is the default).
tier_multiprocess() {
	local rc=0
	# Every other *CrossProcess* test, which the unit tier skips: the
	# conformance suite's own runs come below, per transport.
	run_go_tests multiprocess -run "CrossProcess" -skip "^TestConformanceSoftCrossProcess\$" ./verbstest/ ./cluster/ . || rc=1
	run_go_tests multiprocess-session -run "CrossProcess" ./session/ ./stream/ || rc=1
	run_go_tests multiprocess-collective -run "CrossProcess" ./collective/ || rc=1
	for tr in tcp unix shm; do
		GOVERBS_SOFT_TRANSPORT=$tr run_go_tests "multiprocess-conformance-$tr" \
			-run "^TestConformanceSoft(CrossProcess)?\$" . || rc=1
	done
	GOVERBS_SOFT_TRANSPORT=tcp GOVERBS_SOFT_TLS=on run_go_tests "multiprocess-conformance-tls" \
		-run "^TestConformanceSoft(CrossProcess)?\$" . || rc=1
	for tr in unix shm; do
		GOVERBS_SOFT_PULL=0 GOVERBS_SOFT_TRANSPORT=$tr run_go_tests "multiprocess-conformance-$tr-copied" \
			-run "^TestConformanceSoftCrossProcess\$" . || rc=1
	done
	return $rc
}

# Tier 3: the hardware provider (-tags ibverbs) against the kernel's
# SoftRoCE driver, in a QEMU/TCG guest with two rxe devices (scripts/vm).
# Each test binary is built on the host and run in the guest through
# go test -exec; tests that need the VM skip (with the reason) elsewhere.
# The guest is 10-50x slower than the host, so only the packages that touch
# the hardware provider run there: the provider's own tests, the root
# package's tests of every device (named Test...Devices: the conformance
# suite on rxe0/rxe1, the RDMA CM API across rxe0 and rxe1, error texts,
# addressing, memlock accounting) and TestCMNotSupported, the channel
# package's tests of every device (channels connected by the RDMA CM), the
# session package's (sessions on rxe0/rxe1 over both bootstraps: async-rdma's
# scenarios between two processes, a killed peer, the automatic choice of the
# device that routes to the peer), the goverbs
# command on rxe, and the cgo crossings of the data path once more with the
# shim's per-call counters compiled in (-tags ibv_count, TestCgoCrossings).
tier_vm() {
	local exec=(-tags ibverbs -p 1 -exec "$PWD/scripts/vm/run.sh --")
	./scripts/vm/run.sh --prepare
	# Every part runs, whatever failed before it: a failure must not hide
	# the counts of the parts after it.
	local rc=0
	run_go_tests vm "${exec[@]}" ./internal/ibv/... ./internal/vmtest/ ./cmd/goverbs/ || rc=1
	run_go_tests vm-conformance "${exec[@]}" -run "^(Test[A-Za-z]*Devices|TestCMNotSupported)$" . || rc=1
	run_go_tests vm-channel "${exec[@]}" -run "^(Test[A-Za-z]*Devices|TestCMNotSupported)$" ./channel/ || rc=1
	run_go_tests vm-session "${exec[@]}" -run "^Test[A-Za-z]*Devices$" ./session/ ./stream/ || rc=1
	run_go_tests vm-collective "${exec[@]}" -run "^Test[A-Za-z]*Devices$" ./collective/ || rc=1
	run_go_tests vm-cgo-count -tags ibverbs,ibv_count -p 1 -exec "$PWD/scripts/vm/run.sh --" -run "^TestCgoCrossings$" ./internal/ibv/ || rc=1
	return $rc
}

# ---- main --------------------------------------------------------------------

./scripts/deps.sh
if ! ./scripts/lint.sh; then
	echo "test: lint failed (see above); tests not run"
	exit 1
fi

# Build the summarizer once; it is stdlib-only, so it builds even while
# other packages of the repo do not.
go build -o "$SUMMARY" ./internal/tools/testsummary

status=0
for tier in $ALL_TIERS; do
	if [[ " $TIERS " != *" $tier "* ]]; then
		echo "tier $tier: not run (${NOT_RUN_REASON[$tier]:-not in TIERS})"
		continue
	fi
	if ! declare -F "tier_$tier" >/dev/null; then
		echo "tier $tier: not run (no function tier_$tier in scripts/test.sh)"
		status=1
		continue
	fi
	"tier_$tier" || status=1
done
# A tier named in TIERS but unknown to ALL_TIERS is a typo: fail loudly.
for tier in $TIERS; do
	if [[ " $ALL_TIERS " != *" $tier "* ]]; then
		echo "tier $tier: unknown tier (known: $ALL_TIERS)"
		status=1
	fi
done

# The closing line: the sum over all tiers that ran, alone on its line.
read -r passed failed skipped pkgfails < <(
	awk '{p += $2; f += $3; s += $4; k += $5} END {print p + 0, f + 0, s + 0, k + 0}' "$COUNTS"
)
if ((failed + pkgfails > 0)); then
	status=1
fi
if ((pkgfails > 0)); then
	echo "$pkgfails package or build failure(s) outside any test: see the tier summaries above"
fi
# Every failure once more, next to the closing line, so that the end of a
# long log names them.
if [[ -s "$FAILED" ]]; then
	echo
	echo "failed, in all tiers:"
	sed 's/^/  /' "$FAILED"
fi
echo
echo "$passed passed, $failed failed, $skipped skipped"
exit "$status"
