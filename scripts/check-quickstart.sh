#!/usr/bin/env bash
#
# make check-quickstart: the README's quick start, its commands as the
# README writes them, as root in a minimal Debian 12 without an init system
# (a "debootstrap --variant=minbase bookworm" chroot, as a container is):
# nothing installed beforehand, no policy-rc.d of ours, so that what
# scripts/deps.sh installs must configure without starting a service.
#
# The chroot is made once (QUICKSTART_CACHE, by default
# /var/cache/idempotency-quickstart: bookworm-minbase, about 2 minutes from
# Debian's mirror) and each run works in a fresh copy of it, removed at the
# end.  Only the host's resolv.conf, the stable release's -updates and
# -security suites (as an installed system has them) and the host's own
# certificate authorities (for npm, through whatever the host trusts) go in
# besides the checkout.
#
# "make test" runs the suites QUICKSTART_SUITES names ("installcheck docs"
# by default: its install step installs what every suite needs either way;
# "all" runs every suite, about 10 minutes more).  After the commands, no
# process may be left running in the chroot (a service started by an
# install), and the policy-rc.d that scripts/deps.sh puts in place must be
# gone again.
#
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/chroot-common.sh

if [ "$(id -u)" -ne 0 ]; then
	echo "make check-quickstart runs as root (debootstrap, mount, chroot)" >&2
	exit 1
fi

cache=$(realpath -m "${QUICKSTART_CACHE:-/var/cache/idempotency-quickstart}")
base=$cache/bookworm-minbase
root=$cache/run

# The quick start's commands: the indented lines of the README's
# "## Quick start" section, up to the first paragraph after them, without
# their comments.
commands=$(awk '
	/^## Quick start/ { in_section = 1; next }
	in_section && /^## / { exit }
	in_section && /^    [^ ]/ { sub(/^    /, ""); sub(/ *#.*/, ""); if ($0 != "") print; seen = 1; next }
	in_section && seen && /^[^ ]/ { exit }
' README.md)
if [ -z "$commands" ]; then
	echo "no commands found in README.md's quick start" >&2
	exit 1
fi

if [ ! -x "$base/usr/bin/apt-get" ] || [ -e "$base/debootstrap" ]; then
	command -v debootstrap >/dev/null || apt-get install -y -q --no-install-recommends debootstrap
	echo "== debootstrap --variant=minbase bookworm $base"
	rm -rf "$base"
	mkdir -p "$cache"
	debootstrap --variant=minbase bookworm "$base" "$mirror" >"$cache/debootstrap.log" 2>&1 || {
		tail -n 20 "$cache/debootstrap.log" >&2
		exit 1
	}
fi

cleanup() {
	release_chroot "$root"
	rm -rf "$root"
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

release_chroot "$root"
rm -rf "$root"
cp -a "$base" "$root"
mount_chroot "$root"
cp /etc/resolv.conf "$root/etc/resolv.conf"
{
	echo "deb $mirror bookworm main"
	echo "deb $mirror bookworm-updates main"
	echo "deb ${mirror}-security bookworm-security main"
} >"$root/etc/apt/sources.list"
if [ -d /usr/local/share/ca-certificates ]; then
	mkdir -p "$root/usr/local/share/ca-certificates"
	cp -R /usr/local/share/ca-certificates/. "$root/usr/local/share/ca-certificates/"
fi
copy_checkout "$root/root/idempotency"

suites=${QUICKSTART_SUITES:-installcheck docs}
[ "$suites" = all ] && suites=
echo "== the quick start in a minbase chroot (make test: SUITES=${suites:-all})"
printf '   %s\n' "$commands"
start=$SECONDS
# set -e: the first command that fails ends the run, as it would stop a
# reader; each command's time is printed after it
script='set -e; cd /root/idempotency'
while IFS= read -r command; do
	script+=$'\n'"echo $(printf %q "+ $command"); s=\$SECONDS; { $command; } || exit 1"
	script+=$'\n'"echo \"== \$((SECONDS - s)) s: \"$(printf %q "$command")"
done <<<"$commands"
vars=()
[ -n "$suites" ] && vars=(SUITES="$suites")
in_chroot "$root" "$script" "${vars[@]}"
echo "== the quick start passed in $(((SECONDS - start) / 60)) min $(((SECONDS - start) % 60)) s"

left=
for proc in /proc/[0-9]*; do
	if [ "$(readlink "$proc/root" 2>/dev/null)" = "$root" ]; then
		left+="$(tr '\0' ' ' <"$proc/cmdline")"$'\n'
	fi
done
if [ -n "$left" ]; then
	echo "processes left running in the chroot (a service started by an install?):" >&2
	echo "$left" >&2
	exit 1
fi
if [ -e "$root/usr/sbin/policy-rc.d" ]; then
	echo "scripts/deps.sh left its /usr/sbin/policy-rc.d behind" >&2
	exit 1
fi
echo "== no process left running, no policy-rc.d left behind"
