#!/usr/bin/env bash
#
# make check-sql-edition: the SQL edition (dist/idempotency-sql--<version>.sql,
# built here by scripts/build-sql-edition.py) against a server that has never
# seen the C edition, and against the C edition's own tests:
#
#   1. a private copy of the server's tree without any idempotency file
#      (library, control file, scripts), checked to hold none; a server
#      started from it without shared_preload_libraries;
#   2. the script run with psql -v ON_ERROR_STOP=1 -f by a role that is not
#      a superuser and holds only CREATE on its database; run again, a clear
#      error and nothing changed;
#   3. the catalogs of both editions compared (sql-edition/test/catalog.sql),
#      the C edition's from a second server that preloads the installed
#      library: tables, views, types, columns, constraints, indexes,
#      comments, grants and function signatures must be identical;
#   4. pg_regress with the C edition's sql/keys_*.sql, sql/events*.sql and
#      sql/outbox*.sql, and pg_isolation_regress with its specs/claim_*.spec,
#      specs/events_*.spec and specs/outbox_*.spec, against the C edition's expected output as
#      sql-edition/differences.patch changes it: every difference between
#      the editions is a hunk of that one file, with the reason above it,
#      and a patch that no longer applies fails the suite;
#   5. the differential fuzz (test/fuzz/diff_editions.py): the same random
#      call sequences on both editions, the same results and SQLSTATEs;
#   6. the TAP tests both editions pass (t/IdemTest.pm), the script
#      installed by that role on a server of the private tree;
#   7. the client packages' tests (clients/*/test.sh: Express, Fastify,
#      ASGI, Django, Flask and the consumers), each against a database where
#      that role installed the script.
#
# VIA=pgtle (make check-pgtle) installs the edition through pg_tle instead:
# the server preloads pg_tle only, idempotency-pgtle--<version>.sql is run
# by a role that holds pgtle_admin and CREATE on the database, then that
# role runs CREATE EXTENSION idempotency; the same catalog comparison and
# the same tests follow (sql-edition/test/sql/pgtle_setup.sql in place of
# sql_edition_setup.sql).  pg_tle must be installed in the server tree.
#
# PG_CONFIG picks the server; the C edition must be installed in it for
# step 3 (make test installs it first).  KEEP_WORKDIR=1 keeps the scratch
# directory.
#
set -uo pipefail
cd "$(dirname "$0")/.."
src=$PWD

PG_CONFIG=${PG_CONFIG:-pg_config}
bindir=$("$PG_CONFIG" --bindir) || exit 1
pkglibdir=$("$PG_CONFIG" --pkglibdir)
sharedir=$("$PG_CONFIG" --sharedir)
pgxs_dir=$(dirname "$("$PG_CONFIG" --pgxs)")
pg_regress=$pgxs_dir/../test/regress/pg_regress
pg_isolation_regress=$pgxs_dir/../test/isolation/pg_isolation_regress
user=$(id -un)
via=${VIA:-script}
case $via in script | pgtle) ;; *) echo "sql-edition: VIA is script or pgtle" >&2; exit 2 ;; esac

work=$(mktemp -d "${TMPDIR:-/tmp}/idempotency-sql-edition.XXXXXX")
chmod 755 "$work"
servers=()
cleanup() {
	for data in "${servers[@]}"; do
		"$bindir/pg_ctl" -D "$data" -m immediate stop >/dev/null 2>&1
	done
	if [ -n "${KEEP_WORKDIR:-}" ]; then echo "(kept $work)"; else rm -rf "$work"; fi
}
trap cleanup EXIT
fail() { echo "sql-edition: $*" >&2; exit 1; }

free_port() {
	local port=$((20000 + RANDOM % 20000))
	while (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null || [ -e "$work/.s.PGSQL.$port" ] ||
		[ "$port" = "${1:-}" ]; do
		port=$((port + 1))
	done
	echo "$port"
}

# start_server NAME BINDIR PORT [extra postgresql.conf lines]
start_server() {
	local data=$work/$1 bin=$2 port=$3
	"$bin/initdb" -D "$data" -A trust -U "$user" --no-sync >/dev/null || fail "initdb $1"
	{
		echo "port = $port"
		echo "listen_addresses = ''"
		echo "unix_socket_directories = '$work'"
		echo "max_connections = 60"
		echo "fsync = off"
		[ -n "${4:-}" ] && echo "$4"
	} >>"$data/postgresql.conf"
	"$bin/pg_ctl" -D "$data" -l "$work/$1.log" -w start >/dev/null || { cat "$work/$1.log"; fail "cannot start $1"; }
	servers+=("$data")
}

echo "-- make dist"
python3 scripts/build-sql-edition.py --out "$work/dist" >/dev/null || exit 1
script=$(ls "$work"/dist/idempotency-sql--*.sql)
pgtle_script=$(ls "$work"/dist/idempotency-pgtle--*.sql)

# -- 1. a server tree without the C edition
tree=$work/tree
mkdir -p "$tree$bindir" "$tree$pkglibdir" "$tree$sharedir"
cp -a "$bindir/." "$tree$bindir/"
[ "$pkglibdir" = "$bindir" ] || cp -a "$pkglibdir/." "$tree$pkglibdir/"
cp -a "$sharedir/." "$tree$sharedir/"
find "$tree" -name 'idempotency*' -exec rm -rf {} +
left=$(find "$tree" -name '*idempotency*')
[ -z "$left" ] || fail "the private tree still holds $left"
[ "$("$tree$bindir/pg_config" --pkglibdir)" = "$tree$pkglibdir" ] ||
	fail "the private tree's server does not look in its own lib dir"

sql_port=$(free_port)
preload=
if [ "$via" = pgtle ]; then
	[ -e "$tree$sharedir/extension/pg_tle.control" ] || fail "pg_tle is not installed in $sharedir (doc/testing.md says how to get it)"
	preload=pg_tle
fi
start_server sql-server "$tree$bindir" "$sql_port" "shared_preload_libraries = '$preload'"
psql_sql() { "$bindir/psql" -X -q -v ON_ERROR_STOP=1 -h "$work" -p "$sql_port" "$@"; }
[ "$(psql_sql -U "$user" -d postgres -Atc "SELECT current_setting('shared_preload_libraries') || '|' ||
	(SELECT count(*) FROM pg_available_extensions WHERE name = 'idempotency')")" = "$preload|0" ] ||
	fail "the SQL edition's server preloads something else than '$preload' or offers the C edition"
echo "server without the C edition: $tree (no idempotency file; shared_preload_libraries '$preload')"

# -- 2. installed by a role that only holds CREATE on its database (and
# pgtle_admin, through pg_tle)
psql_sql -U "$user" -d postgres -c "CREATE ROLE idem_owner LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE" \
	-c "CREATE DATABASE sql_edition" || exit 1
psql_sql -U "$user" -d sql_edition -c "REVOKE CREATE ON SCHEMA public FROM PUBLIC" \
	-c "GRANT CREATE ON DATABASE sql_edition TO idem_owner" || exit 1
if [ "$via" = pgtle ]; then
	psql_sql -U "$user" -d sql_edition -c "CREATE EXTENSION pg_tle" -c "GRANT pgtle_admin TO idem_owner" || exit 1
	install() {
		psql_sql -U idem_owner -d sql_edition -o /dev/null -f "$pgtle_script" &&
			psql_sql -U idem_owner -d sql_edition -c "CREATE EXTENSION idempotency"
	}
	already='ERROR:  extension "idempotency" already installed'
	how="registered through pg_tle and created (CREATE EXTENSION) by a role with only pgtle_admin and CREATE on the database"
else
	install() { psql_sql -U idem_owner -d sql_edition -f "$script"; }
	already='ERROR:  schema "idempotency" already exists'
	how="installed by a role with only CREATE on the database"
fi
install >"$work/install.out" 2>&1 ||
	{ cat "$work/install.out"; fail "the $via install failed as a role with only CREATE on the database"; }
[ ! -s "$work/install.out" ] || { cat "$work/install.out"; fail "the install printed something (above) where it should print nothing"; }
psql_sql -U "$user" -d sql_edition -f sql-edition/test/catalog.sql >"$work/catalog-sql.txt" || exit 1
if install >"$work/install-again.out" 2>&1; then
	fail "the install ran twice"
fi
grep -q "$already" "$work/install-again.out" ||
	{ cat "$work/install-again.out"; fail "installing twice did not say why it stopped"; }
psql_sql -U "$user" -d sql_edition -f sql-edition/test/catalog.sql | cmp -s - "$work/catalog-sql.txt" ||
	fail "installing twice changed the catalog"
echo "$how; a second install refused, nothing changed"

# -- 3. the catalogs of both editions
status=0
if [ -e "$pkglibdir/idempotency.so" ]; then
	c_port=$(free_port "$sql_port")
	start_server c-server "$bindir" "$c_port" "shared_preload_libraries = 'idempotency'"
	"$bindir/psql" -X -q -v ON_ERROR_STOP=1 -h "$work" -p "$c_port" -U "$user" -d postgres \
		-c "CREATE EXTENSION idempotency" -f sql-edition/test/catalog.sql >"$work/catalog-c.txt" || exit 1
	grep 'public-execute true' "$work/catalog-sql.txt" && fail "a helper of the SQL edition is executable by PUBLIC"
	# the SQL edition's own helpers (those the C edition does not have) apart
	grep -v -x -F -f <(grep '^helper ' "$work/catalog-c.txt") "$work/catalog-sql.txt" |
		grep '^helper ' >"$work/helpers.txt"
	if diff -u "$work/catalog-c.txt" <(grep -v -x -F -f "$work/helpers.txt" "$work/catalog-sql.txt") \
		>"$work/catalog.diff"; then
		echo "catalogs: identical ($(wc -l <"$work/catalog-c.txt") facts; $(wc -l <"$work/helpers.txt") helpers of the SQL edition's own, none for PUBLIC)"
	else
		cat "$work/catalog.diff"
		echo "catalogs: the editions differ (above: - C edition, + SQL edition)"
		status=1
	fi
	# the C library's DDL guard leaves alone the tables of a database
	# without the C edition: there the SQL edition installs, and its tables
	# take what the guard refuses on the C edition's
	psql_c() { "$bindir/psql" -X -q -v ON_ERROR_STOP=1 -h "$work" -p "$c_port" -U "$user" "$@"; }
	psql_c -d postgres -c "CREATE DATABASE sql_beside_c" || exit 1
	if psql_c -d sql_beside_c -o /dev/null -f "$script" >"$work/beside.out" 2>&1 &&
		psql_c -d sql_beside_c -c "CREATE UNIQUE INDEX ON idempotency.keys (key, scope)" >>"$work/beside.out" 2>&1; then
		echo "a server that preloads the C library: the SQL edition installs in a database without the C edition, its tables unguarded"
	else
		cat "$work/beside.out"
		echo "a server that preloads the C library: the SQL edition did not install in a database without the C edition (above)"
		status=1
	fi
else
	echo "catalogs: not compared (the C edition is not installed in $pkglibdir)"
	status=1
fi

# -- 4. the C edition's tests, with the differences of sql-edition/differences.patch
t=$work/t
mkdir -p "$t/sql" "$t/expected" "$t/specs"
regress=(keys_claim keys_claim_scan keys_complete keys_lease keys_extend_lease keys_wait keys_fingerprint
	keys_input keys_release_policy keys_security events events_batch maintenance_purge
	outbox outbox_batch outbox_routes outbox_fetch_plan)
isolation=(claim_concurrent claim_rollback claim_lease claim_isolation_levels claim_result_times
	claim_wait claim_wait_lease events_concurrent events_batch_concurrent
	outbox_order outbox_relays outbox_per_key outbox_fences)
for f in "${regress[@]}"; do cp "sql/$f.sql" "expected/$f.out" "$t/sql/" 2>/dev/null; mv "$t/sql/$f.out" "$t/expected/"; done
for f in "${isolation[@]}"; do cp "specs/$f.spec" "$t/specs/"; cp "expected/$f.out" "$t/expected/"; done
# The SQL edition's errors come from PL/pgSQL, which adds a CONTEXT line
# naming the function: messages, details, hints and SQLSTATEs are compared,
# not the context (a line added to each file and to its expected output).
for f in "${regress[@]}"; do
	for file in "$t/sql/$f.sql" "$t/expected/$f.out"; do
		{ echo '\set SHOW_CONTEXT never'; cat "$file"; } >"$file.new" && mv "$file.new" "$file"
	done
done
cp sql-edition/test/sql/*.sql "$t/sql/"
cp sql-edition/test/expected/*.out "$t/expected/"
# through pg_tle the edition is an extension: the differences that come
# from the plain script's being none ("Plain script only") are left out
python3 /dev/stdin "$via" "$src/sql-edition/differences.patch" >"$work/differences.patch" <<'PY' || exit 1
import sys
with open(sys.argv[2], encoding="utf-8") as f:
    lines = f.read().splitlines(keepends=True)
if sys.argv[1] == "pgtle":
    # a file's section: its reason (a block of comment lines), then its diff
    sections, previous = [], ""
    for line in lines:
        if line.startswith("#") and not previous.startswith("#"):
            sections.append([])
        if not sections:
            sections.append([])
        sections[-1].append(line)
        previous = line
    lines = [line for section in sections if "Plain script only" not in "".join(section) for line in section]
sys.stdout.write("".join(lines))
PY
(cd "$t" && patch -p1 --quiet --no-backup-if-mismatch <"$work/differences.patch") ||
	fail "sql-edition/differences.patch does not apply to the C edition's tests any more: bring it up to date"
# the specs install the edition where the C edition's create the extension
if [ "$via" = pgtle ]; then
	sed -i 's/CREATE EXTENSION idempotency;/SET ROLE idem_owner; CREATE EXTENSION idempotency; RESET ROLE;/' "$t"/specs/*.spec
	setup=pgtle_setup
else
	sed -i -e 's/CREATE EXTENSION idempotency;/SET ROLE idem_owner; SELECT public.install_sql_edition(); RESET ROLE;/' \
		-e 's/DROP EXTENSION idempotency;/DROP SCHEMA idempotency CASCADE;/' "$t"/specs/*.spec
	setup=sql_edition_setup
fi
sed -i -e "s|@script@|$script|" -e "s|@pgtle_script@|$pgtle_script|" "$t/sql/sql_edition_setup.sql" "$t/sql/pgtle_setup.sql"

# From PostgreSQL 16 the expected output is looked for in --expecteddir,
# which is not --inputdir's but the current directory unless given: the
# patched copies are in $t.
expecteddir=()
"$pg_regress" --help 2>/dev/null | grep -q -- --expecteddir && expecteddir=(--expecteddir="$t")

echo "-- pg_regress: $setup ${regress[*]} sql_edition_maintenance sql_edition_outbox"
"$pg_regress" --bindir="$bindir" --inputdir="$t" "${expecteddir[@]}" --outputdir="$t" --host="$work" --port="$sql_port" \
	--user="$user" --dbname=sql_edition_regress "$setup" "${regress[@]}" sql_edition_maintenance sql_edition_outbox || {
	status=1; cat "$t/regression.diffs"; }

# the isolation database: the script kept in a table, installed by a function
# that runs it as the role that ran it (the specs' setup: SET ROLE idem_owner)
psql_sql -U "$user" -d postgres -c "CREATE DATABASE sql_edition_iso" || exit 1
if [ "$via" = pgtle ]; then
	# the specs create the extension as idem_owner, registered here once
	psql_sql -U "$user" -d sql_edition_iso -c "GRANT CREATE ON DATABASE sql_edition_iso TO idem_owner" \
		-c "CREATE EXTENSION pg_tle" || exit 1
	psql_sql -U idem_owner -d sql_edition_iso -o /dev/null -f "$pgtle_script" || exit 1
else
psql_sql -U "$user" -d sql_edition_iso -v script="$script" <<'SQL' || exit 1
GRANT CREATE ON DATABASE sql_edition_iso TO idem_owner;
CREATE TABLE public.sql_edition_script AS
	SELECT regexp_replace(regexp_replace(pg_read_file(:'script'), '^BEGIN;$', '', 'm'), '^COMMIT;$', '', 'm') AS script;
CREATE FUNCTION public.install_sql_edition() RETURNS void LANGUAGE plpgsql
AS $$ BEGIN EXECUTE (SELECT script FROM public.sql_edition_script); END $$;
GRANT SELECT ON public.sql_edition_script TO idem_owner;
SQL
fi
echo "-- pg_isolation_regress: ${isolation[*]}"
mkdir -p "$t/iso"
"$pg_isolation_regress" --bindir="$bindir" --inputdir="$t" "${expecteddir[@]}" --outputdir="$t/iso" --host="$work" \
	--port="$sql_port" --user="$user" --use-existing --dbname=sql_edition_iso "${isolation[@]}" || {
	status=1; cat "$t/iso/regression.diffs"; }

# -- 5. the differential fuzz: the same random call sequences on both
# editions, the same results and errors (test/fuzz/diff_editions.py, about
# DIFF_SECONDS, 30 by default)
if [ "$via" = script ] && [ -n "${c_port:-}" ]; then
	psql_sql -U "$user" -d postgres -c "CREATE DATABASE diff_fuzz OWNER idem_owner" || exit 1
	psql_sql -U idem_owner -d diff_fuzz -f "$script" || exit 1
	"$bindir/psql" -X -q -v ON_ERROR_STOP=1 -h "$work" -p "$c_port" -U "$user" -d postgres \
		-c "CREATE DATABASE diff_fuzz" || exit 1
	"$bindir/psql" -X -q -v ON_ERROR_STOP=1 -h "$work" -p "$c_port" -U "$user" -d diff_fuzz \
		-c "CREATE EXTENSION idempotency" || exit 1
	echo "-- differential fuzz (test/fuzz/diff_editions.py)"
	DIFF_C_DSN="host=$work port=$c_port dbname=diff_fuzz user=$user" \
		DIFF_SQL_DSN="host=$work port=$sql_port dbname=diff_fuzz user=$user" \
		/usr/bin/python3 test/fuzz/diff_editions.py || status=1
fi

# -- 6. the TAP tests that both editions pass (t/IdemTest.pm says how
# each installs the edition and what differs), against the private tree's
# server: the script installed as a role with only CREATE on the database,
# nothing preloaded
if [ "$via" = script ]; then
	tap=(t/001_claim_race.pl t/014_claim_wait.pl t/016_notify_truncated.pl)
	echo "-- prove (IDEM_EDITION=sql): ${tap[*]}"
	mkdir -p "$work/tap"
	if ! PATH="$tree$bindir:$PATH" PG_REGRESS="$pg_regress" IDEM_EDITION=sql IDEM_SQL_SCRIPT="$script" \
		TESTDIR="$work/tap" TESTDATADIR="$work/tap/tmp_check" TESTLOGDIR="$work/tap/log" \
		prove -I "$pgxs_dir/../test/perl" -I . "${tap[@]}"; then
		status=1
		for log in "$work"/tap/log/regress_log_* "$work"/tap/tmp_check/log/regress_log_*; do
			[ -e "$log" ] && { echo "-- $log (last 60 lines)"; tail -n 60 "$log"; }
		done
	fi
fi

# The client packages (clients/*/test.sh) against the SQL edition, each in
# a database of its own where the edition's owner installed it
if [ "$via" = script ]; then
	for test in clients/*/test.sh; do
		client=$(basename "$(dirname "$test")")
		db=clients_$client
		psql_sql -U "$user" -d postgres -c "CREATE DATABASE $db" || exit 1
		psql_sql -U "$user" -d "$db" -c "GRANT CREATE ON DATABASE $db TO idem_owner" || exit 1
		psql_sql -U idem_owner -d "$db" -o /dev/null -f "$script" || exit 1
		echo "-- $test (the SQL edition)"
		mkdir -p "$work/$db"
		if (cd "$(dirname "$test")" && PGHOST=$work PGPORT=$sql_port PGUSER=$user PGDATABASE=$db \
			IDEM_VIA=direct IDEM_SQL_SCRIPT=$script EXAMPLE_TMP=$work/$db ./test.sh); then
			echo "ok: $test (the SQL edition)"
		else
			echo "FAILED: $test (the SQL edition)"
			status=1
		fi
	done
fi

exit $status
