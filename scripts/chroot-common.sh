# Shared by scripts/matrix.sh and bench/chroot.sh: finishing the set-up of a
# release's debootstrap chroot, and copying the checkout into it.  Each step
# is idempotent, so that a chroot is set up again on every use.
#
#   - the host's own trusted certificate authorities are copied in: npm
#     reaches its registry through whatever the host trusts.
#   - /usr/sbin/policy-rc.d exits 101, so that installing postgresql-NN does
#     not start its cluster (nor anything else start a service).
#   - sid's Release file says how long it is valid, which a mirror's copy
#     may outlive: apt is told not to check.  The stable releases get their
#     -updates and -security suites, as an installed system has them.
#   - the checkout goes in as git sees it, tracked files and new ones but
#     nothing ignored: built objects of the host's version must not come
#     along, and .git, results and node_modules are not needed.

mirror=http://deb.debian.org/debian

# in_chroot ROOT COMMAND [VAR=value...]: COMMAND run by bash, as root, in a
# clean environment with those variables
in_chroot() {
	local dir=$1 command=$2
	shift 2
	chroot "$dir" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
		PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
		DEBIAN_FRONTEND=noninteractive "$@" /bin/bash -c "$command"
}

# mount_chroot ROOT: what the servers and tools inside need: proc, sys,
# /dev, /dev/pts and a tmpfs on /dev/shm (the servers' dynamic shared
# memory); release_chroot unmounts them
mount_chroot() {
	local dir=$1
	mount -t proc proc "$dir/proc"
	mount --bind /sys "$dir/sys"
	mount --bind /dev "$dir/dev"
	mount --bind /dev/pts "$dir/dev/pts"
	mount -t tmpfs -o mode=1777 tmpfs "$dir/dev/shm"
}

# release_chroot ROOT: end what runs in the chroot (only the calling script
# starts anything there) and unmount everything under it, innermost first.
release_chroot() {
	local dir=$1 proc mounts mount
	for proc in /proc/[0-9]*; do
		if [ "$(readlink "$proc/root" 2>/dev/null)" = "$dir" ]; then
			kill -KILL "${proc#/proc/}" 2>/dev/null || true # gone meanwhile
		fi
	done
	mounts=$(awk -v dir="$dir" '$2 == dir || index($2, dir "/") == 1 { print $2 }' /proc/self/mounts | tac)
	for mount in $mounts; do
		# a process killed just now may not have let go yet: detach it then
		umount "$mount" 2>/dev/null || umount --lazy "$mount"
	done
	return 0
}

# configure_chroot ROOT SUITE: with proc, sys and /dev mounted already
configure_chroot() {
	local dir=$1 suite=$2
	cp /etc/resolv.conf "$dir/etc/resolv.conf"
	printf '#!/bin/sh\nexit 101\n' >"$dir/usr/sbin/policy-rc.d"
	chmod 755 "$dir/usr/sbin/policy-rc.d"
	{
		echo "deb $mirror $suite main"
		if [ "$suite" != sid ]; then
			echo "deb $mirror $suite-updates main"
			echo "deb ${mirror}-security $suite-security main"
		fi
	} >"$dir/etc/apt/sources.list"
	if [ "$suite" = sid ]; then
		echo 'Acquire::Check-Valid-Until "false";' >"$dir/etc/apt/apt.conf.d/99idempotency-matrix"
	fi
	if [ -d /usr/local/share/ca-certificates ]; then
		mkdir -p "$dir/usr/local/share/ca-certificates"
		cp -R /usr/local/share/ca-certificates/. "$dir/usr/local/share/ca-certificates/"
	fi

	# dpkg --configure -a: what a run killed halfway through apt left
	in_chroot "$dir" 'dpkg --configure -a && apt-get update -qq &&
		apt-get install -y -qq --no-install-recommends ca-certificates make >/dev/null &&
		update-ca-certificates >/dev/null'
}

# copy_checkout DIR: the checkout (the current directory) into DIR, emptied
copy_checkout() {
	local dest=$1
	rm -rf "$dest"
	mkdir -p "$dest"
	git ls-files -z -co --exclude-standard |
		while IFS= read -r -d '' file; do
			# a tracked file deleted in the work tree is not there to copy
			if [ -e "$file" ] || [ -L "$file" ]; then printf '%s\0' "$file"; fi
		done |
		tar --null -T - -cf - | tar -C "$dest" -xf -
}
