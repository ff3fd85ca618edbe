# Shared by test.sh and demo.sh: who runs the servers, and with which binaries.
#
# initdb refuses to run as root, so when invoked as root the servers run as
# the unprivileged "postgres" OS user (created by Debian's postgresql-common),
# in a directory that user can write.

PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
PGBIN=$("$PG_CONFIG" --bindir)

if [ "$(id -u)" -eq 0 ]; then
	RUN_AS=postgres
	id "$RUN_AS" >/dev/null 2>&1 ||
		useradd --system --home-dir /var/lib/postgresql --shell /bin/bash "$RUN_AS"
	as_runner() { runuser -u "$RUN_AS" -- "$@"; }
else
	RUN_AS=$(id -un)
	as_runner() { "$@"; }
fi

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
