#!/usr/bin/env bash
# scripts/deps.sh — install what the build, lint and tests need on a fresh
# Debian machine. Idempotent: when everything is present it installs nothing
# and does not touch apt.
#
# Needs:
#   go              /usr/local/go (not installed here: the machine provides it)
#   gcc, libc6-dev  cgo, which `go test -race` needs on linux
#   libibverbs-dev  optional: headers for `go vet -tags ibverbs` (internal/ibv)
#   librdmacm-dev   optional: headers for the RDMA CM part of internal/ibv
#   openmpi-bin, mpich  optional: real launchers for the examples/network and
#                   examples/allreduce tests
#   iproute2        optional: ip(8), for the two-host test of soft0 over TCP
#                   (network namespaces, verbstest TestCrossProcessHosts)
set -euo pipefail

if ! command -v go >/dev/null 2>&1; then
	export PATH=/usr/local/go/bin:$PATH
fi
if ! command -v go >/dev/null 2>&1; then
	echo "deps: go not found on PATH nor in /usr/local/go/bin" >&2
	exit 1
fi

# Collect the Debian packages that are missing, each detected by a file it
# provides so that the check needs neither apt nor dpkg.
required=()
optional=()
command -v gcc >/dev/null 2>&1 || required+=(gcc)
[[ -e /usr/include/stdio.h ]] || required+=(libc6-dev)
[[ -e /usr/include/infiniband/verbs.h ]] || optional+=(libibverbs-dev)
[[ -e /usr/include/rdma/rdma_cma.h ]] || optional+=(librdmacm-dev)
[[ -e /usr/bin/mpirun.openmpi ]] || optional+=(openmpi-bin)
[[ -e /usr/bin/mpiexec.hydra ]] || optional+=(mpich)
command -v ip >/dev/null 2>&1 || [[ -x /usr/sbin/ip || -x /sbin/ip ]] || optional+=(iproute2)

if ((${#required[@]} + ${#optional[@]} == 0)); then
	echo "deps: all present ($(go version))"
	exit 0
fi

# apt needs root; use sudo when there is one and we are not root.
SUDO=()
if [[ $(id -u) -ne 0 ]]; then
	if command -v sudo >/dev/null 2>&1; then
		SUDO=(sudo)
	else
		echo "deps: not root and no sudo: cannot install ${required[*]} ${optional[*]}" >&2
		((${#required[@]} == 0)) && exit 0
		exit 1
	fi
fi

apt_install() {
	DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y --no-install-recommends "$@"
}

echo "deps: installing ${required[*]} ${optional[*]}"
"${SUDO[@]}" apt-get update -qq
if ((${#required[@]} > 0)); then
	apt_install "${required[@]}"
fi
if ((${#optional[@]} > 0)); then
	# Optional: a failure here only means `go vet -tags ibverbs` is skipped.
	apt_install "${optional[@]}" || echo "deps: warning: could not install ${optional[*]} (optional)" >&2
fi
echo "deps: done"
