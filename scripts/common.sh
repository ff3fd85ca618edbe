# Shared by deps.sh, test.sh, demo.sh, bench.sh and with-server.sh: which
# server version, who runs the servers, and with which binaries.
#
# The server version (PG_MAJOR) is, in this order:
#   - PG_MAJOR, when given;
#   - the version of PG_CONFIG, when given: its --version if it runs, else
#     the NN of a /usr/lib/postgresql/NN/ path (not installed yet);
#   - the newest installed /usr/lib/postgresql/NN/bin/pg_config;
#   - the default server of this Debian release, the postgresql-NN that the
#     "postgresql" package depends on (15 on bookworm, 17 on trixie), so
#     that "make test" on a fresh system tests the release's own server.
# PG_CONFIG is then that version's pg_config unless it was given.  Both are
# exported, so that scripts/deps.sh installs that version's packages.
#
# initdb refuses to run as root, so when invoked as root the servers run as
# the unprivileged "postgres" OS user (created by Debian's postgresql-common),
# in a directory that user can write.  The runner's commands start from /:
# runuser keeps the working directory, and a checkout under /root is one
# that user cannot enter.

pg_major_of_debian() {
	local major
	# a fresh system has no package lists yet
	if [ -z "$(apt-cache depends postgresql 2>/dev/null)" ] && [ "$(id -u)" -eq 0 ]; then
		apt-get update -qq >&2
	fi
	major=$(apt-cache depends postgresql 2>/dev/null |
		sed -n 's/^ *Depends: postgresql-\([0-9][0-9]*\)$/\1/p' | head -n 1)
	if [ -z "$major" ]; then
		echo "cannot tell which PostgreSQL to use: set PG_MAJOR=NN or PG_CONFIG" >&2
		return 1
	fi
	echo "$major"
}

pg_major() {
	local newest
	if [ -n "${PG_MAJOR:-}" ]; then
		echo "$PG_MAJOR"
	elif [ -n "${PG_CONFIG:-}" ] && "$PG_CONFIG" --version >/dev/null 2>&1; then
		# "PostgreSQL 17.6 (Debian 17.6-1)", "PostgreSQL 19devel"
		"$PG_CONFIG" --version | sed -n 's/^PostgreSQL \([0-9][0-9]*\).*/\1/p'
	elif [[ ${PG_CONFIG:-} =~ ^/usr/lib/postgresql/([0-9]+)/ ]]; then
		echo "${BASH_REMATCH[1]}"
	elif [ -n "${PG_CONFIG:-}" ]; then
		echo "PG_CONFIG=$PG_CONFIG does not run, and its path names no version: set PG_MAJOR=NN too" >&2
		return 1
	elif newest=$(ls -d /usr/lib/postgresql/*/bin/pg_config 2>/dev/null | sort -V | tail -n 1) &&
		[ -n "$newest" ]; then
		echo "$newest" | cut -d/ -f5
	else
		pg_major_of_debian
	fi
}

PG_MAJOR=$(pg_major) || exit 1
PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/$PG_MAJOR/bin/pg_config}
export PG_MAJOR PG_CONFIG

if [ "$(id -u)" -eq 0 ]; then
	RUN_AS=postgres
	as_runner() { (cd / && runuser -u "$RUN_AS" -- "$@"); }
else
	RUN_AS=$(id -un)
	as_runner() { "$@"; }
fi

# After scripts/deps.sh: the server's binaries, and the runner's account.
use_server() {
	PGBIN=$("$PG_CONFIG" --bindir) || exit 1
	if [ "$(id -u)" -eq 0 ] && ! id "$RUN_AS" >/dev/null 2>&1; then
		useradd --system --home-dir /var/lib/postgresql --shell /bin/bash "$RUN_AS"
	fi
}

# A scratch directory the runner owns; removed by the caller.
runner_tmpdir() {
	local dir
	dir=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-$1.XXXXXX")
	chmod 755 "$dir"
	[ "$(id -u)" -eq 0 ] && chown "$RUN_AS" "$dir"
	echo "$dir"
}

# Build and install the extension (install needs root, or a writable libdir).
build_and_install() {
	make -s PG_CONFIG="$PG_CONFIG" >/dev/null
	make -s PG_CONFIG="$PG_CONFIG" install >/dev/null
}
