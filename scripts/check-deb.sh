#!/usr/bin/env bash
#
# make check-deb: build the Debian package the way Debian builds its
# PostgreSQL extensions (debian/, pg_buildext), install it, and run make
# installcheck's pg_regress and isolation suites against a temporary server
# that preloads the INSTALLED library, so that the package is what is tested,
# not a build of the tree.
#
#   1. install what is missing (build dependencies, the server, pgbouncer)
#   2. build postgresql-NN-idempotency with dpkg-buildpackage in a scratch
#      copy of the tree (uncommitted changes included, build products left
#      out), with the upstream flags, -Werror included
#   3. check what the .deb ships, and install it with apt-get
#   4. run installcheck (TAP_TESTS=) in another copy, which has no build of
#      its own, through scripts/with-server.sh as the unprivileged runner,
#      after checking that the server mapped the package's idempotency.so
#
# The server version NN is PG_MAJOR, else PG_CONFIG's version (the Makefile
# passes its PG_CONFIG), else the default server of this Debian release.
# The package is removed again at the end, and any files it replaced (a
# "make install") are put back, unless it was installed before or
# KEEP_PACKAGE=1; KEEP_WORKDIR=1 keeps the scratch directory.  Run as root.
#
set -euo pipefail
umask 022
cd "$(dirname "$0")/.."
src=$PWD
. scripts/apt.sh

step="setup"
say() { echo "== $*"; }

if [ "$(id -u)" -ne 0 ]; then
	echo "check-deb: run as root: it installs packages (make check-deb as root)" >&2
	exit 1
fi
export DEBIAN_FRONTEND=noninteractive

# apt-get install those of the packages given that are not installed
updated=
need() {
	local missing=() p
	for p; do
		[ "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null)" = installed ] ||
			missing+=("$p")
	done
	[ ${#missing[@]} -eq 0 ] && return 0
	if [ -z "$updated" ]; then
		apt-get update -qq
		updated=1
	fi
	apt_guarded_install "${major:-}" "$step" --no-upgrade -- "${missing[@]}"
}

# The server version
if [ -n "${PG_MAJOR:-}" ]; then
	major=$PG_MAJOR
elif [[ ${PG_CONFIG:-} =~ ^/usr/lib/postgresql/([0-9]+)/bin/pg_config$ ]]; then
	major=${BASH_REMATCH[1]}
elif [ -n "${PG_CONFIG:-}" ] && pgversion=$("$PG_CONFIG" --version 2>/dev/null); then
	# "PostgreSQL 17.6 (Debian 17.6-1)", "PostgreSQL 19devel"
	major=$(echo "$pgversion" | sed -n 's/^PostgreSQL \([0-9][0-9]*\).*/\1/p')
else
	need postgresql-common
	major=$(/usr/share/postgresql-common/supported-versions | tail -n 1)
fi
if ! [[ $major =~ ^[0-9]+$ ]]; then
	echo "check-deb: cannot tell the server version (PG_CONFIG=${PG_CONFIG:-}): set PG_MAJOR=NN" >&2
	exit 1
fi
pkg=postgresql-$major-idempotency
pgc=/usr/lib/postgresql/$major/bin/pg_config

step="installing the dependencies"
need build-essential dpkg-dev debhelper fakeroot postgresql-server-dev-all \
	"postgresql-server-dev-$major" "postgresql-$major" "postgresql-client-$major" pgbouncer
[ -x "$pgc" ] || {
	echo "check-deb: $pgc is missing after installing postgresql-server-dev-$major" >&2
	exit 1
}
so=$("$pgc" --pkglibdir)/idempotency.so

# The runner of the servers (initdb refuses root), as in scripts/common.sh.
# runuser keeps the working directory, which may be one that user cannot
# enter (a checkout under /root): its commands start from /.
runner=postgres
id "$runner" >/dev/null 2>&1 ||
	useradd --system --home-dir /var/lib/postgresql --shell /bin/bash "$runner"
as_runner() { (cd / && runuser -u "$runner" -- "$@"); }

scratch=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-deb.XXXXXX")
chmod 755 "$scratch"
installed_here=
version="(not built)"

# copy the files named on stdin that exist to $scratch/before (by path)
save_files() {
	local f
	while read -r f; do
		if [ -f "$f" ] || [ -L "$f" ]; then
			mkdir -p "$scratch/before${f%/*}" && cp -a "$f" "$scratch/before$f"
		fi
	done
}

finish() {
	local status=$?
	trap - EXIT
	set +e
	if [ -n "$installed_here" ] && [ -z "${KEEP_PACKAGE:-}" ]; then
		# what someone installed over the package's files since is theirs now
		dpkg --verify "$pkg" 2>/dev/null | awk '{ print $NF }' | save_files
		dpkg --purge "$pkg" >/dev/null
		(cd "$scratch/before" && find . ! -type d) | while read -r f; do
			f=${f#.}
			mkdir -p "${f%/*}" && cp -a "$scratch/before$f" "$f"
		done
		echo "(removed $pkg again and put back what it replaced; KEEP_PACKAGE=1 keeps it)"
	fi
	if [ -n "${KEEP_WORKDIR:-}" ]; then
		echo "(keeping $scratch)"
	else
		rm -rf "$scratch"
	fi
	if [ $status -eq 0 ]; then
		echo "check-deb: passed: $pkg $version built, installed, and installcheck passed against its installed library (PostgreSQL $major)"
	else
		echo "check-deb: FAILED ($step): $pkg, PostgreSQL $major"
	fi
	exit $status
}
trap finish EXIT
trap 'exit 1' INT TERM HUP

# The tree without its VCS and build products: stale objects would be linked
# as they are, and the package and the suites must not see a build.
copy_tree() {
	tar -C "$src" --exclude=./.git --exclude='*.o' --exclude='*.so' --exclude='*.bc' \
		--exclude='./tmp_check*' --exclude=./results --exclude=./output_iso --exclude=./log \
		--exclude='./regression.*' --exclude=node_modules \
		--exclude=./debian/.debhelper --exclude=./debian/files --exclude='./debian/*.substvars' \
		--exclude=./debian/debhelper-build-stamp --exclude='./debian/postgresql-*-idempotency' \
		-cf - . | tar -C "$1" -xf -
}

step="building the package"
say "build $pkg (dpkg-buildpackage, PostgreSQL $("$pgc" --version | awk '{ print $2 }'))"
build=$scratch/idempotency
mkdir "$build"
copy_tree "$build"
(
	cd "$build"
	# only the version under test, whatever else is installed
	export PG_SUPPORTED_VERSIONS=$major
	export DEB_BUILD_OPTIONS=${DEB_BUILD_OPTIONS:-parallel=$(nproc)}
	pg_buildext updatecontrol
	dpkg-buildpackage -us -uc -b
) >"$scratch/build.log" 2>&1 || {
	tail -n 60 "$scratch/build.log"
	exit 1
}
# the upstream flags reached every compilation
compiled=$(grep -c -- ' -c -o src/[^ ]*\.o ' "$scratch/build.log" || :)
werror=$(grep -- ' -c -o src/[^ ]*\.o ' "$scratch/build.log" | grep -c -- ' -Werror ' || :)
if [ "$compiled" -eq 0 ] || [ "$werror" -ne "$compiled" ]; then
	echo "check-deb: $werror of $compiled objects were compiled with -Werror" >&2
	exit 1
fi
debs=("$scratch/${pkg}_"*.deb)
if [ ${#debs[@]} -ne 1 ] || [ ! -f "${debs[0]}" ]; then
	echo "check-deb: expected one ${pkg}_*.deb, found: ${debs[*]}" >&2
	exit 1
fi
deb=${debs[0]}
version=$(dpkg-deb -f "$deb" Version)
echo "$(basename "$deb"): $compiled objects compiled with -Werror"
echo "Depends: $(dpkg-deb -f "$deb" Depends)"

step="checking the package's files"
dpkg-deb -c "$deb" | tee "$scratch/contents"
# files: the library and its bitcode, the control and SQL files, the docs;
# directories: only those that hold one of them
awk -v lib="/usr/lib/postgresql/$major/lib/" -v ext="/usr/share/postgresql/$major/extension/" \
	-v doc="/usr/share/doc/$pkg/" '
	{ name = substr($6, 2) }
	name ~ /\/$/ { dirs[name] = 1; next }
	name == lib "idempotency.so" || name == ext "idempotency.control" { needed++ }
	name == lib "idempotency.so" || index(name, lib "bitcode/idempotency") == 1 ||
		name == ext "idempotency.control" || index(name, ext "idempotency--") == 1 ||
		index(name, doc) == 1 { files[name] = 1; next }
	{ print "unexpected in the package: " name; bad = 1 }
	END {
		for (d in dirs) {
			used = 0
			for (f in files)
				if (index(f, d) == 1) used = 1
			if (!used) { print "unexpected directory in the package: " d; bad = 1 }
		}
		if (needed != 2) { print "the library or the control file is missing"; bad = 1 }
		exit bad
	}' "$scratch/contents"
grep -q " \./usr/share/postgresql/$major/extension/idempotency--1\.0\.sql$" "$scratch/contents" || {
	echo "check-deb: idempotency--1.0.sql is missing" >&2
	exit 1
}
grep -q " \./usr/share/doc/$pkg/examples/queries\.yaml$" "$scratch/contents" || {
	echo "check-deb: the exporter's queries file (examples/queries.yaml) is missing" >&2
	exit 1
}

step="installing the package"
if [ "$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null)" != installed ]; then
	# files of the package that are there already (a "make install"), to
	# put back when it is removed
	mkdir "$scratch/before"
	installed_here=1
	awk '$1 !~ /^d/ { print substr($6, 2) }' "$scratch/contents" | save_files
fi
say "install $(basename "$deb")"
apt_guarded_install "$major" "$step" --reinstall -- "$deb"
owner=$(dpkg -S "$so" | cut -d: -f1)
[ "$owner" = "$pkg" ] || {
	echo "check-deb: $so belongs to '$owner', not $pkg" >&2
	exit 1
}
[ -z "$(dpkg --verify "$pkg")" ] || {
	dpkg --verify "$pkg"
	exit 1
}
echo "$so: $owner $(dpkg-query -W -f='${Version}' "$pkg")"

step="installcheck"
say "installcheck against the installed package"
# The suites write their results next to the tests: a copy the runner owns,
# with no build in it.
work=$scratch/test
mkdir "$work"
copy_tree "$work"
cat >"$scratch/installcheck.sh" <<'EOF'
#!/usr/bin/env bash
# Run by scripts/with-server.sh: the server must have mapped the package's
# library (the path given), then the pg_regress and isolation suites.
set -euo pipefail
umask 022
so=$1
bindir=$("$PG_CONFIG" --bindir)
datadir=$("$bindir/psql" -X -At -d postgres -c 'SHOW data_directory')
pid=$(head -n 1 "$datadir/postmaster.pid")
loaded=$(awk '$6 ~ /\/idempotency\.so$/ { print $6; exit }' "/proc/$pid/maps")
echo "the server (pid $pid) has mapped ${loaded:-no idempotency.so}"
[ "$loaded" = "$so" ] || {
	echo "expected $so" >&2
	exit 1
}
make --no-print-directory PG_CONFIG="$PG_CONFIG" installcheck TAP_TESTS=
EOF
chmod 755 "$scratch/installcheck.sh"
chown -R "$runner" "$work"
if ! as_runner env PG_CONFIG="$pgc" "$work/scripts/with-server.sh" \
	"$scratch/installcheck.sh" "$so"; then
	for diffs in "$work/regression.diffs" "$work/output_iso/regression.diffs"; do
		[ -s "$diffs" ] && { echo "-- $diffs"; cat "$diffs"; }
	done
	exit 1
fi
# nothing replaced the package's files while the suites ran
step="checking the installed files"
[ -z "$(dpkg --verify "$pkg")" ] || {
	echo "check-deb: the package's files changed during the run:" >&2
	dpkg --verify "$pkg" >&2
	exit 1
}
