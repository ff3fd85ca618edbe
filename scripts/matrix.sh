#!/usr/bin/env bash
#
# make test-matrix: the whole "make test" on each Debian release's own
# PostgreSQL, in a chroot per release, one after the other:
#
#   bookworm  PostgreSQL 15
#   trixie    PostgreSQL 17
#   sid       PostgreSQL 18
#
# MATRIX="17 18", or arguments (versions or release names), pick a subset.
# Then "make check-deb" as well, when the Makefile has that target (the
# Debian package, built, installed and checked), as a part of its own.
# Prints a line per release at the end, and for each failing part its
# failing tests, the first lines of each diff and the end of its log; exits
# non-zero if any part failed.  Runs as root.
#
# Each chroot is a "debootstrap --variant=minbase" in MATRIX_CACHE
# (/var/cache/idempotency-matrix/<release>), made on first use and reused
# after: every run finishes setting it up again, each step idempotent, and
# make test installs the release's PostgreSQL there itself (scripts/deps.sh),
# as it would on a fresh system; one whose setup fails (a run killed inside
# dpkg, a disk that was full) is made again from nothing, once.  The logs are
# kept there too, a file per release and part.  The unusual steps:
#
#   - proc, sys, /dev, /dev/pts and a tmpfs on /dev/shm (the servers' dynamic
#     shared memory) are mounted for the run and unmounted on every way out;
#     a run that was killed left its mounts, and processes, behind: the next
#     one ends those processes (by their root, which is the chroot) and
#     unmounts before it starts, as it does when it stops.  Long steps run in
#     the background, waited for, so that a signal stops the run at once.
#   - the rest of the set-up (a policy-rc.d that keeps packages from
#     starting services, the apt sources, the host's certificate
#     authorities, make) and the copy of the checkout are
#     scripts/chroot-common.sh's, shared with bench/chroot.sh.
#
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/chroot-common.sh

cache=${MATRIX_CACHE:-/var/cache/idempotency-matrix}
releases=(bookworm:15 trixie:17 sid:18)

if [ "$(id -u)" -ne 0 ]; then
	echo "make test-matrix runs as root (debootstrap, mount, chroot)" >&2
	exit 1
fi

# which releases: MATRIX or the arguments, as versions or names
want=${*:-${MATRIX:-}}
picked=()
for release in "${releases[@]}"; do
	if [ -z "$want" ] || [[ " $want " == *" ${release%:*} "* ]] || [[ " $want " == *" ${release#*:} "* ]]; then
		picked+=("$release")
	fi
done
if [ ${#picked[@]} -eq 0 ]; then
	echo "MATRIX=\"$want\" names none of: ${releases[*]}" >&2
	exit 1
fi

command -v debootstrap >/dev/null || {
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
}
mkdir -p "$cache"
cache=$(realpath "$cache")

root= # the chroot in use, for cleanup
child= # the step running in the background

cleanup() {
	[ -n "$child" ] && kill "$child" 2>/dev/null
	[ -n "$root" ] && release_chroot "$root"
	[ -n "$root" ] && release_chroot "$root.new"
	return 0
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

# background LOG COMMAND..., then waited: its status.  Started outside any
# "if", or errexit would be off for the whole of it.
background() {
	local log=$1
	shift
	"$@" >"$log" 2>&1 &
	child=$!
}
waited() {
	local status=0
	wait "$child" || status=$?
	child=
	return $status
}

# A finished debootstrap removes its own work directory, /debootstrap; one
# that was stopped halfway is started again from nothing, in $root.new.
# (release_chroot has unmounted everything under both, or failed.)
make_chroot() {
	local suite=$1
	[ -x "$root/usr/bin/apt-get" ] && [ ! -e "$root/debootstrap" ] && return 0
	rm -rf "$root" "$root.new"
	debootstrap --variant=minbase "$suite" "$root.new" "$mirror"
	mv "$root.new" "$root"
}

setup_chroot() {
	local suite=$1
	make_chroot "$suite"

	mount_chroot "$root"

	configure_chroot "$root" "$suite"
	copy_checkout "$root/root/idempotency"
}

elapsed() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

summary=()
failures=()
for release in "${picked[@]}"; do
	suite=${release%:*}
	major=${release#*:}
	root=$cache/$suite
	release_chroot "$root"
	release_chroot "$root.new"
	echo "== $suite (PostgreSQL $major): logs in $cache/$suite.*.log"

	start=$SECONDS
	setup_ok=true
	background "$cache/$suite.setup.log" setup_chroot "$suite"
	waited || setup_ok=false
	if ! $setup_ok && [ -x "$root/usr/bin/apt-get" ]; then
		# A cached chroot that no longer sets up (a run killed inside
		# dpkg, a disk that was full) is made again from nothing, once.
		echo "   the cached chroot did not set up ($cache/$suite.setup-cached.log): making it again"
		mv "$cache/$suite.setup.log" "$cache/$suite.setup-cached.log"
		release_chroot "$root"
		rm -rf "$root"
		setup_ok=true
		background "$cache/$suite.setup.log" setup_chroot "$suite"
		waited || setup_ok=false
	fi
	if ! $setup_ok; then
		summary+=("PostgreSQL $major ($suite): setup FAILED ($(elapsed $((SECONDS - start))))")
		failures+=("$cache/$suite.setup.log")
		release_chroot "$root"
		continue
	fi
	line="setup $(elapsed $((SECONDS - start)))"

	start=$SECONDS
	background "$cache/$suite.test.log" in_chroot "$root" 'cd /root/idempotency && make test'
	if waited; then
		line+=", test passed"
	else
		line+=", test FAILED"
		failures+=("$cache/$suite.test.log")
	fi
	line+=" ($(elapsed $((SECONDS - start))))"

	if grep -q '^check-deb[[:space:]]*:' Makefile; then
		start=$SECONDS
		background "$cache/$suite.check-deb.log" in_chroot "$root" 'cd /root/idempotency && make check-deb'
		if waited; then
			line+=", check-deb passed"
		else
			line+=", check-deb FAILED"
			failures+=("$cache/$suite.check-deb.log")
		fi
		line+=" ($(elapsed $((SECONDS - start))))"
	fi

	# the version make test picked and installed, the release's default
	version=$(in_chroot "$root" 'for c in /usr/lib/postgresql/*/bin/pg_config; do "$c" --version; done' 2>/dev/null |
		sort -V | tail -n 1 | awk '{ print $2 }')
	summary+=("PostgreSQL ${version:-$major} ($suite): $line")
	release_chroot "$root"
done
root=

# what failed: the failing tests and errors, the first changed lines of
# each diff, then the log's last lines
for log in "${failures[@]}"; do
	echo
	echo "-- $log"
	awk '/^[^-+ @]/ { changed = 0 }
		/^diff / { print; changed = 6; next }
		changed > 0 && /^[-+][^-+]/ { print; changed--; next }
		/^not ok|Failed test|Bail out|FAILED|[Ee]rror:/ { print }' "$log" | head -n 60
	echo "   ..."
	tail -n 6 "$log"
done
echo
echo "== matrix"
printf '%s\n' "${summary[@]}"
[ ${#failures[@]} -eq 0 ]
