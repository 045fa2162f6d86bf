#!/usr/bin/env bash
# scripts/lint.sh — static checks. Runs every check, prints a line per check,
# and exits non-zero if any of them failed.
#
#   gofmt           no file may need reformatting
#   vet             go vet ./...
#   build-nocgo     CGO_ENABLED=0 go build ./...  (the pure-Go build must work)
#   vet-ibverbs     go vet -tags ibverbs ./...    (only with libibverbs headers)
#   staticcheck     go tool staticcheck ./...     (version pinned by go.mod's tool directive)
#   cgo-confined    import "C" only in files under internal/ibv/
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v go >/dev/null 2>&1 || export PATH=/usr/local/go/bin:$PATH

IBVERBS_HEADER=/usr/include/infiniband/verbs.h
failed=()

# run NAME CMD... — run one check, recording its failure.
run() {
	local name=$1
	shift
	echo "==== lint: $name: $*"
	if "$@"; then
		echo "---- lint: $name: ok"
	else
		echo "---- lint: $name: FAILED"
		failed+=("$name")
	fi
}

# All .go files of the repo, NUL-separated, leaving out .git and the VM
# artefacts in .cache.
go_files() {
	find . \( -path ./.git -o -path ./.cache \) -prune -o -type f -name '*.go' -print0
}

check_gofmt() {
	local files=() bad
	# testdata may hold deliberately odd Go files.
	mapfile -d '' files < <(go_files | grep -zv '/testdata/' || true)
	((${#files[@]} > 0)) || return 0
	# gofmt exits non-zero on a file it cannot parse: that fails too.
	bad=$(gofmt -l "${files[@]}") || return 1
	if [[ -n $bad ]]; then
		echo "these files need gofmt -w:"
		echo "$bad"
		return 1
	fi
}

check_cgo_confined() {
	# A line that is `import "C"`, or `"C"` alone inside an import block.
	local bad
	bad=$(go_files | xargs -0r grep -lE '^[[:space:]]*(import[[:space:]]+)?"C"[[:space:]]*(//.*)?$' |
		grep -v '^\./internal/ibv/' || true)
	if [[ -n $bad ]]; then
		echo 'import "C" is allowed only under internal/ibv/; found in:'
		echo "$bad"
		return 1
	fi
}

run gofmt check_gofmt
run vet go vet ./...
run build-nocgo env CGO_ENABLED=0 go build ./...
if [[ -e $IBVERBS_HEADER ]]; then
	run vet-ibverbs go vet -tags ibverbs ./...
	run staticcheck-ibverbs go tool staticcheck -tags ibverbs ./...
else
	echo "==== lint: vet-ibverbs: skipped ($IBVERBS_HEADER not found; scripts/deps.sh installs libibverbs-dev)"
fi
run staticcheck go tool staticcheck ./...
run cgo-confined check_cgo_confined

if ((${#failed[@]} > 0)); then
	echo "lint: FAILED: ${failed[*]}"
	exit 1
fi
echo "lint: all checks passed"
