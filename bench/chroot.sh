#!/usr/bin/env bash
#
# bench/chroot.sh RELEASE [COMMAND]: make bench (or COMMAND, run by bash in
# the checkout's copy) inside one of make test-matrix's chroots, as root:
# RELEASE is bookworm, trixie or sid, or its PostgreSQL version (15, 17, 18).
# BENCH_* variables are passed in.  The chroot must exist already (make
# test-matrix MATRIX=17 makes it); it is set up again as make test-matrix
# does (scripts/chroot-common.sh: make, the apt sources, a policy-rc.d that
# keeps PostgreSQL's packages from starting a cluster), and make bench
# installs the release's PostgreSQL there on first use.
#
# As scripts/matrix.sh does: proc, sys, /dev, /dev/pts and a tmpfs on
# /dev/shm are mounted for the run, and the checkout goes in as git sees it
# (tracked files and new ones, nothing ignored), here to
# /root/idempotency-bench.  A chroot in use (processes running in it, or
# anything mounted under it: a matrix run) is left alone.  On every way out,
# the processes started in the chroot meanwhile are ended, and what was
# mounted is unmounted.
#
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/chroot-common.sh

cache=${MATRIX_CACHE:-/var/cache/idempotency-matrix}
case ${1:-} in
15 | bookworm) release=bookworm ;;
17 | trixie) release=trixie ;;
18 | sid) release=sid ;;
*)
	echo "usage: bench/chroot.sh bookworm|trixie|sid|15|17|18 [COMMAND]" >&2
	exit 2
	;;
esac
command=${2:-make bench}
root=$(realpath -m "$cache/$release")

if [ "$(id -u)" -ne 0 ]; then
	echo "bench/chroot.sh runs as root (mount, chroot)" >&2
	exit 1
fi
if [ ! -x "$root/usr/bin/apt-get" ] || [ -e "$root/debootstrap" ]; then
	echo "no chroot in $root: make test-matrix MATRIX=$release makes it" >&2
	exit 1
fi

in_root() {
	local proc
	for proc in /proc/[0-9]*; do
		[ "$(readlink "$proc/root" 2>/dev/null)" = "$root" ] && echo "${proc#/proc/}"
	done
	return 0
}
if [ -n "$(in_root)" ] ||
	awk -v dir="$root" 'index($2, dir "/") == 1 { found = 1 } END { exit !found }' /proc/self/mounts; then
	echo "$root is in use (processes run in it, or something is mounted under it)" >&2
	exit 1
fi

child=
cleanup() {
	[ -n "$child" ] && kill "$child" 2>/dev/null
	# only this script has started anything there since the check above
	release_chroot "$root"
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

mount_chroot "$root"
configure_chroot "$root" "$release"
copy_checkout "$root/root/idempotency-bench"

passed=()
for name in $(compgen -e); do
	[[ $name == BENCH_* ]] && passed+=("$name=${!name}")
done
in_chroot "$root" "cd /root/idempotency-bench && $command" "${passed[@]}" &
child=$!
status=0
wait "$child" || status=$?
child=
exit $status
