#!/usr/bin/env bash
#
# make check-sanitize: build the extension with AddressSanitizer and
# UndefinedBehaviorSanitizer, run test suites against servers that load THAT
# build, and fail on any sanitizer report as on any suite failure.  SUITES
# picks them (default: "installcheck fuzz tap"; on two cores, about 4
# minutes for the first two, 6 for tap, 3.5 for citus):
#
#   installcheck  installcheck's pg_regress and isolation suites
#   fuzz          make check-fuzz's fuzzers
#   tap           the TAP suite, t/*.pl: the background worker (publish,
#                 purge, launcher), standbys, crashes, dumps, upgrades
#   citus         the Citus suite, t/citus/*.pl (a coordinator and two
#                 workers: the shards' code paths), when the citus extension
#                 is installed in the server; one line says so when not
#
#   1. copy the tree (uncommitted changes included, build products left out)
#      to a scratch directory the runner owns, and build it there with
#        COPT = -fsanitize=address,undefined -fno-sanitize-recover=all
#               -fno-omit-frame-pointer -fno-wrapv
#      COPT is what PGXS appends to both CFLAGS and LDFLAGS, so the
#      Makefile's PG_CFLAGS (-Wall -Wextra -Werror ...) stay as they are;
#      with_llvm=no, as the server must not inline bitcode of another build.
#      -fno-wrapv because PGXS compiles with -fwrapv, which makes signed
#      overflow defined and so switches gcc's signed-integer-overflow check
#      off: here overflow in the extension's code is reported instead.
#      SANITIZE_WRAPV=1 keeps -fwrapv (and loses that check).
#   2. a private installation of the server: the build is installed with
#      DESTDIR into the scratch directory, the rest of the server's pkglibdir
#      and sharedir are symlinked next to it (citus.so and citus.control
#      among them, when installed), and copies of the server's (plain,
#      uninstrumented) programs go into the copy of its bindir.  PostgreSQL
#      computes its sharedir and pkglibdir relative to where its binary is
#      (and initdb and pg_ctl find postgres next to themselves), so that
#      server's $libdir, where shared_preload_libraries and the extension's
#      'MODULE_PATHNAME' ('$libdir/idempotency') both find the library, is
#      the private lib dir, and CREATE EXTENSION reads the tree's control
#      and SQL files.  The system's installation is not touched: other runs
#      can use it at the same time.
#   3. the sanitizer runtimes, LD_PRELOADed into every server process and
#      whatever starts one (libasan first, as the binaries are not
#      instrumented, and a small library of our own that initializes the
#      runtimes early: see sanitizer_early.c below), ASan's reports going
#      to files under the scratch directory, UBSan's to the server's log,
#      each aborting the process.  Every server is checked: its postmaster
#      and a backend run the private binary and have mapped libasan,
#      libubsan and the private idempotency.so, and no other idempotency.so.
#   4. for installcheck and fuzz: initdb, then start that postmaster and
#      check it
#   5. the suites: make installcheck TAP_TESTS= against that server
#      (PGHOST, PGPORT, PGUSER, as scripts/with-server.sh gives them), then
#      the fuzzers of make check-fuzz, through scripts/check-fuzz.sh
#      --with-server (sqlsmith and python3-psycopg are installed first, as
#      root, when missing); the server is then stopped.  Then make check-tap
#      and check-citus with the private bindir first in prove's PATH, so
#      that the clusters the tests start (PostgreSQL::Test::Cluster) run the
#      private programs, with the runtimes preloaded into prove and all it
#      starts: perl, psql, pg_ctl, the nodes; each suite's first test is one
#      of this script's, a node started as the tests start theirs, whose
#      maps are checked as the server's are.
#   6. fail if a suite failed, if there is any sanitizer report (ASan's
#      log_path files, a report in a server's or a node's log), or if a
#      server process crashed (in the TAP suites, which kill processes on
#      purpose: one that aborted or faulted); the reports are printed
#
# As root, the build and the servers run as the unprivileged runner (the
# postgres OS user), as in make test.  The server version is
# scripts/common.sh's pick (PG_MAJOR=NN or PG_CONFIG=...).  KEEP_WORKDIR=1
# keeps the scratch directory, with the build, the logs and the results
# (the TAP suites' in tmp_check-tap and tmp_check-citus).
#
# What the sanitizers can and cannot see: the extension's own code is
# instrumented, the server is not.  ASan catches out-of-bounds accesses to
# the extension's stack and global variables, and to malloc'd memory (GUC
# extras, large pallocs that get a malloc'd block of their own, which is
# anything over 8kB in a default memory context); reads and writes through
# the intercepted libc functions (memcpy, strlen, ...) are checked wherever
# they are called from.  It does NOT see overflows within a small palloc'd
# chunk or use of a pfree'd chunk: memory contexts carve chunks out of big
# malloc'd blocks that ASan knows only as a whole.  UBSan checks the
# extension's code for signed overflow, shifts, misaligned or null pointer
# use, out-of-range conversions, bounds of arrays of known size, etc.
# The server's settings are test/idempotency.conf's, with those of
# scripts/with-server.sh but its TCP listener, and jit = off: the server's
# own code is not instrumented, so its stack use is what it always is, and
# max_stack_depth stays at its default.  The TAP suites' nodes have their
# tests' settings; JIT is unavailable to them, as llvmjit is not linked into
# the private lib dir.  Citus's library is not instrumented either: only
# the libc calls it makes are checked.
#
set -uo pipefail
umask 022
cd "$(dirname "$0")/.." || exit 1
src=$PWD
started=$SECONDS

. scripts/common.sh

say() { echo "== $* ($((SECONDS - started))s)"; }
fail() {
	echo "check-sanitize: $*" >&2
	exit 1
}

if [ "$(id -u)" -eq 0 ]; then
	scripts/deps.sh || exit 1
fi
use_server

command -v gcc >/dev/null || fail "gcc is missing"
asan=$(gcc -print-file-name=libasan.so)
ubsan=$(gcc -print-file-name=libubsan.so)
[ -e "$asan" ] && [ -e "$ubsan" ] ||
	fail "gcc's libasan.so or libubsan.so is missing (libgcc-NN-dev, libasan8, libubsan1)"
asan=$(readlink -f "$asan")
ubsan=$(readlink -f "$ubsan")

bindir=$("$PG_CONFIG" --bindir)
pkglibdir=$("$PG_CONFIG" --pkglibdir)
sharedir=$("$PG_CONFIG" --sharedir)
[ -x "$bindir/postgres" ] || fail "$bindir/postgres is missing"

suites=${SUITES:-installcheck fuzz tap}
for suite in $suites; do
	case $suite in
	installcheck | fuzz | tap | citus) ;;
	*) fail "SUITES: no suite '$suite' (installcheck, fuzz, tap, citus)" ;;
	esac
done
wants() { [[ " $suites " == *" $1 "* ]]; }

sanitize="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
[ -n "${SANITIZE_WRAPV:-}" ] || sanitize="$sanitize -fno-wrapv"
make_args=(PG_CONFIG="$PG_CONFIG" with_llvm=no "COPT=$sanitize")

work=$(runner_tmpdir sanitize)
tree=$work/tree
inst=$work/inst
# where scripts/with-server.sh has its instance (check-fuzz.sh looks there)
server=$tree/tmp_check_server
logs=$work/reports
pgdata=$server/data
server_up=

cleanup() {
	local status=$?
	trap - EXIT
	if [ -n "$server_up" ]; then
		as_runner "$bindir/pg_ctl" -D "$pgdata" -m immediate stop >/dev/null 2>&1
	fi
	if [ -n "${KEEP_WORKDIR:-}" ]; then
		echo "(keeping $work)"
	else
		rm -rf "$work"
	fi
	exit $status
}
trap cleanup EXIT
trap 'exit 1' INT TERM HUP

# -- 1. the sanitized build, in a copy of the tree
say "build with $sanitize (PostgreSQL $("$PG_CONFIG" --version | awk '{ print $2 }'))"
mkdir -p "$tree" "$inst" "$logs"
tar -C "$src" --exclude=./.git --exclude='*.o' --exclude='*.so' --exclude='*.bc' \
	--exclude='./tmp_check*' --exclude=./results --exclude=./output_iso --exclude=./log \
	--exclude='./regression.*' --exclude=node_modules --exclude=./debian \
	-cf - . | tar -C "$tree" -xf - || fail "cannot copy the tree"
mkdir -p "$server"
[ "$(id -u)" -eq 0 ] && chown -R "$RUN_AS" "$work"

if ! as_runner nice -n 10 make -C "$tree" --no-print-directory -j"$(nproc)" "${make_args[@]}" \
	>"$work/build.log" 2>&1; then
	# the errors, without the compilers' command lines
	grep -v '^gcc ' "$work/build.log" | tail -n 60
	fail "the sanitized build failed"
fi
# every object got the sanitizer and the warnings-as-errors flags
compiled=$(grep -c -- ' -c -o src/[^ ]*\.o ' "$work/build.log")
flagged=$(grep -- ' -c -o src/[^ ]*\.o ' "$work/build.log" |
	grep -- ' -Werror ' | grep -c -- ' -fsanitize=address,undefined ')
if [ "$compiled" -eq 0 ] || [ "$flagged" -ne "$compiled" ]; then
	cat "$work/build.log"
	fail "$flagged of $compiled objects were compiled with -Werror and the sanitizers"
fi
so=$tree/idempotency.so
undefined=$(nm -D --undefined-only "$so")
grep -q ' __asan_init$' <<<"$undefined" && grep -q ' __ubsan_handle_' <<<"$undefined" ||
	fail "$so is not instrumented"
echo "$compiled objects compiled with -Werror $sanitize"

# -- 2. a private installation: the sanitized build, and the rest of the
# server's files as symlinks
say "private installation under $inst"
as_runner make -C "$tree" --no-print-directory "${make_args[@]}" DESTDIR="$inst" install \
	>"$work/install.log" 2>&1 || {
	cat "$work/install.log"
	fail "make install DESTDIR=$inst failed"
}
# link $1/* into $2, but for the names matching one of the patterns after
link_all() {
	local from=$1 to=$2 f name skip
	shift 2
	mkdir -p "$to"
	for f in "$from"/*; do
		name=${f##*/}
		for skip; do
			# shellcheck disable=SC2053
			[[ $name == $skip ]] && continue 2
		done
		[ -e "$to/$name" ] || ln -s "$f" "$to/$name"
	done
}
run_link() {
	# as the runner, who owns $inst
	as_runner bash -c "$(declare -f link_all); link_all \"\$@\"" link_all "$@"
}
run_link "$pkglibdir" "$inst$pkglibdir" 'idempotency*' bitcode 'llvmjit*'
run_link "$sharedir" "$inst$sharedir" extension
run_link "$sharedir/extension" "$inst$sharedir/extension" 'idempotency*'
# the server's programs are copies: initdb and pg_ctl look for postgres, and
# pg_config for the lib and share dirs, next to where they are once symlinks
# are resolved (the TAP suites run them all from there)
as_runner mkdir -p "$inst$bindir"
as_runner cp -a "$bindir/." "$inst$bindir/"
postgres=$inst$bindir/postgres
[ -f "$inst$pkglibdir/idempotency.so" ] && [ -f "$inst$sharedir/extension/idempotency.control" ] ||
	fail "the install left no idempotency.so or idempotency.control under $inst"

# -- 3. the runtimes, and what every sanitized process is checked for
asan_options="detect_leaks=0:abort_on_error=1:halt_on_error=1:log_path=$logs/asan"
asan_options="$asan_options:detect_odr_violation=0:verify_asan_link_order=0"
# UBSan reports go to the server's stderr, its log: gcc's libubsan, next
# to libasan, writes nothing at all when given a log_path
ubsan_options="print_stacktrace=1:halt_on_error=1:abort_on_error=1"
# Two things the runtimes need from a library of our own, preloaded between
# them (sanitizer_early.so):
#
# - Preloaded into a binary that is not instrumented, libasan initializes
#   itself on the first malloc, unless its constructor came first; but
#   constructors run dependencies first, the preloaded libraries last, and
#   libgpg-error's (postgres -> libsystemd -> libgcrypt -> libgpg-error)
#   calls bindtextdomain, whose malloc then initializes ASan under glibc's
#   _nl_state_lock, and ASan's initialization calls dlerror, which takes and
#   releases that same lock: the lock is left broken, and the postmaster
#   hangs in its own bindtextdomain before it logs anything (as ps did in
#   google/sanitizers#1096).  This library is marked DF_1_INITFIRST, so
#   ld.so runs its constructor before any other, and that initializes ASan,
#   as the .preinit_array of an instrumented executable would.
# - libubsan reads UBSAN_OPTIONS when it first reports, in the backend, and
#   from /proc/self/environ, which the server has overwritten with its ps
#   display by then (ASAN_OPTIONS was read at start): the options go in as
#   __ubsan_default_options, which libubsan calls, and this library
#   defines first in the lookup order.
cat >"$work/sanitizer_early.c" <<EOF
extern void __asan_init(void);
const char *__ubsan_default_options(void);

__attribute__((constructor)) static void
sanitizer_early(void)
{
	__asan_init();
}

const char *
__ubsan_default_options(void)
{
	return "$ubsan_options";
}
EOF
gcc -shared -fPIC -Wl,-z,initfirst -o "$work/sanitizer_early.so" "$work/sanitizer_early.c" ||
	fail "cannot build sanitizer_early.so"
chmod 755 "$work/sanitizer_early.so"
preload="$asan $work/sanitizer_early.so $ubsan"

# check_maps WHO MAPS: the process whose /proc/PID/maps is MAPS runs the
# private postgres and has mapped libasan, libubsan and the private
# idempotency.so, and no other idempotency.so; else say what is wrong
check_maps() {
	local who=$1 maps=$2 libs exe
	libs=$(awk '$6 ~ /\/idempotency\.so$/ { print $6 }' <<<"$maps" | sort -u)
	exe=$(awk '$6 ~ /\/postgres$/ { print $6; exit }' <<<"$maps")
	if [ "$libs" != "$inst$pkglibdir/idempotency.so" ]; then
		echo "the $who mapped '${libs:-no idempotency.so}', not (only) $inst$pkglibdir/idempotency.so"
	elif ! grep -q " $asan\$" <<<"$maps"; then
		echo "the $who has not mapped $asan"
	elif ! grep -q " $ubsan\$" <<<"$maps"; then
		echo "the $who has not mapped $ubsan"
	elif [ "$exe" != "$postgres" ]; then
		echo "the $who runs ${exe:-no postgres}, not $postgres"
	else
		return 0
	fi
	return 1
}

# -- 4. the server that installcheck and fuzz run against
if wants installcheck || wants fuzz; then
	say "start the server with $(basename "$asan") and $(basename "$ubsan") preloaded"
	port=5432
	user=$RUN_AS
	as_runner "$bindir/initdb" -D "$pgdata" -A trust -U "$user" --no-sync >"$server/initdb.log" 2>&1 || {
		cat "$server/initdb.log"
		fail "initdb failed"
	}
	as_runner tee -a "$pgdata/postgresql.conf" >/dev/null <<EOF

# check-sanitize (see test/idempotency.conf below)
listen_addresses = ''
unix_socket_directories = '$server'
port = $port
max_connections = 120
wal_level = logical
# JIT would compile plain, not sanitized, code (and loads llvmjit, which is
# not linked into the private lib dir)
jit = off
# the crash of a backend would otherwise be followed by others' errors only
restart_after_crash = off
log_line_prefix = '%m [%p] '
EOF
	as_runner tee -a "$pgdata/postgresql.conf" <"$tree/test/idempotency.conf" >/dev/null

	# pg_ctl and its shell get the runtimes too (LD_PRELOAD is inherited): they
	# are as uninstrumented as the server, and leak checking is off
	if ! as_runner env LD_PRELOAD="$preload" ASAN_OPTIONS="$asan_options" \
		UBSAN_OPTIONS="$ubsan_options" \
		"$bindir/pg_ctl" -D "$pgdata" -p "$postgres" -l "$server/server.log" -w -t 120 start \
		>"$server/pg_ctl.log" 2>&1; then
		cat "$server/pg_ctl.log" "$server/server.log"
		for f in "$logs"/*; do [ -f "$f" ] && { echo "-- $f"; cat "$f"; }; done
		fail "the server did not start"
	fi
	server_up=1
	export PGHOST=$server PGPORT=$port PGUSER=$user

	psql() { as_runner env PGHOST="$PGHOST" PGPORT="$PGPORT" PGUSER="$PGUSER" \
		"$bindir/psql" -X -q -At -v ON_ERROR_STOP=1 -d postgres "$@"; }
	# The mappings of a backend that has called a function of the extension
	# (its probin is '$libdir/idempotency', MODULE_PATHNAME), and the
	# postmaster's
	psql -c "CREATE DATABASE sanitize_check" || fail "CREATE DATABASE failed"
	maps=$(psql -d sanitize_check -c "SET client_min_messages = warning" \
		-c "CREATE EXTENSION idempotency" \
		-c "SELECT 'CREATE EXTENSION: idempotency ' || extversion || ', functions in '
		           || string_agg(DISTINCT p.probin, ', ')
		    FROM pg_extension e, pg_depend d, pg_proc p
		    WHERE e.extname = 'idempotency' AND d.refobjid = e.oid AND d.classid = 'pg_proc'::regclass
		          AND p.oid = d.objid AND p.probin IS NOT NULL
		    GROUP BY extversion" \
		-c "SELECT idempotency.idem_fingerprint('{}'::jsonb) IS NOT NULL AS fingerprint" \
		-c "SELECT pg_read_file('/proc/self/maps')") || fail "cannot call the extension in a backend"
	grep '^CREATE EXTENSION: ' <<<"$maps"
	psql -c "DROP DATABASE sanitize_check WITH (FORCE)" || fail "DROP DATABASE failed"
	pm_pid=$(head -n 1 "$pgdata/postmaster.pid")
	pm_maps=$(cat "/proc/$pm_pid/maps")
	problem=$(check_maps backend "$maps") && problem=$(check_maps "postmaster $pm_pid" "$pm_maps") ||
		fail "$problem"
	echo "the postmaster (pid $pm_pid) and its backends run $postgres"
	echo "with $inst$pkglibdir/idempotency.so, $asan and $ubsan mapped"
fi

# -- 5. the suites
summary=()
status=0
run_suite() {
	local name=$1
	shift
	say "$name"
	if as_runner env PGHOST="$PGHOST" PGPORT="$PGPORT" PGUSER="$PGUSER" \
		nice -n 10 make -C "$tree" --no-print-directory "${make_args[@]}" "$@"; then
		summary+=("$name: passed")
	else
		status=1
		summary+=("$name: FAILED")
		for diffs in "$tree/regression.diffs" "$tree/output_iso/regression.diffs"; do
			[ -s "$diffs" ] && { echo "-- $diffs"; cat "$diffs"; }
		done
	fi
}
if wants installcheck; then
	run_suite installcheck installcheck TAP_TESTS=
fi
# The fuzz suite: scripts/check-fuzz.sh runs against a server that is up
# already when given --with-server (PGHOST, PGPORT, PGUSER, and the server's
# log in ./tmp_check_server/server.log, as scripts/with-server.sh has it)
if wants fuzz; then
	if [ -x "$tree/scripts/check-fuzz.sh" ] && grep -q -- '--with-server' "$tree/scripts/check-fuzz.sh"; then
		missing=()
		command -v sqlsmith >/dev/null || missing+=(sqlsmith)
		/usr/bin/python3 -c 'import psycopg' 2>/dev/null || missing+=(python3-psycopg)
		if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" -eq 0 ]; then
			echo "installing: ${missing[*]}"
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
				"${missing[@]}" >/dev/null && missing=()
		fi
		if [ ${#missing[@]} -gt 0 ]; then
			status=1
			summary+=("fuzz: FAILED (missing ${missing[*]}: install them, or SUITES=installcheck)")
		else
			say "fuzz"
			if as_runner env PGHOST="$PGHOST" PGPORT="$PGPORT" PGUSER="$PGUSER" PG_CONFIG="$PG_CONFIG" \
				"$tree/scripts/check-fuzz.sh" --with-server; then
				summary+=("fuzz: passed")
			else
				status=1
				summary+=("fuzz: FAILED")
			fi
		fi
	else
		summary+=("fuzz: skipped (no scripts/check-fuzz.sh --with-server in this tree)")
	fi
fi

# UBSan's reports and any other that went to stderr, in a server's log
pattern='AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|runtime error:'
reports=0
if [ -n "$server_up" ]; then
	say "stop the server"
	as_runner "$bindir/pg_ctl" -D "$pgdata" -m fast -w -t 120 stop >/dev/null 2>&1 || status=1
	server_up=
	# and any server process that died
	crashed="$pattern|terminated by signal|terminating any other active server processes"
	if grep -Eq "$crashed" "$server/server.log"; then
		reports=$((reports + 1))
		echo "-- in $server/server.log:"
		grep -E -B 2 -A 30 "$crashed" "$server/server.log"
	fi
fi

# The TAP suites start clusters of their own (PostgreSQL::Test::Cluster):
# make's bindir is the private one, which PGXS's prove puts first in the
# PATH, so that the nodes run the private initdb, pg_ctl and postgres, and
# load the private idempotency.so.  The sanitizer runtimes are preloaded
# into prove and everything it starts: perl, psql, pg_ctl, the nodes.  The
# first test is this one, a node started as the tests start theirs, whose
# postmaster's and backend's maps are then checked as the server's are.
cat >"$work/sanitize_maps.pl" <<'EOF'
# check-sanitize: a node as the suite's nodes are, preloading
# $SANITIZE_PRELOAD; the maps of its postmaster and of a backend that has
# called the extension go to $SANITIZE_MAPS.postmaster and .backend
use strict;
use warnings;

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = PostgreSQL::Test::Cluster->new('sanitize_maps');
$node->init;
$node->append_conf('postgresql.conf', "shared_preload_libraries = '$ENV{SANITIZE_PRELOAD}'");
$node->start;
my $backend = $node->safe_psql('postgres', q{
	SET client_min_messages = warning;
	CREATE EXTENSION idempotency;
	SELECT pg_read_file('/proc/self/maps')
	WHERE idempotency.idem_fingerprint('{}'::jsonb) IS NOT NULL;
});
my ($pid) = split /\n/, slurp_file($node->data_dir . '/postmaster.pid');
append_to_file("$ENV{SANITIZE_MAPS}.postmaster", slurp_file("/proc/$pid/maps"));
append_to_file("$ENV{SANITIZE_MAPS}.backend", $backend);
ok($backend ne '', 'a backend called the extension');
$node->stop;
done_testing();
EOF

# run_tap SUITE PRELOAD TESTS: make check-SUITE with the runtimes preloaded,
# PROVE_TESTS the check above (a node preloading PRELOAD) and TESTS; then
# the checks of the maps and of the nodes' logs.  The logs are kept in
# tmp_check-SUITE, as the next suite's prove starts with an empty tmp_check.
run_tap() {
	local name=$1 libraries=$2 tests=$3 problem log crashed
	say "$name"
	if as_runner env LD_PRELOAD="$preload" ASAN_OPTIONS="$asan_options" \
		SANITIZE_PRELOAD="$libraries" SANITIZE_MAPS="$work/maps-$name" \
		nice -n 10 make -C "$tree" --no-print-directory "${make_args[@]}" bindir="$inst$bindir" \
		PROVE_FLAGS=--timer PROVE_TESTS="$work/sanitize_maps.pl $tests" "check-$name"; then
		summary+=("$name: passed")
	else
		status=1
		summary+=("$name: FAILED")
		for log in $(grep -lE '^(not ok|# Looks like|Bail out)' "$tree"/tmp_check/log/regress_log_* 2>/dev/null); do
			echo "-- $log (last 60 lines)"
			tail -n 60 "$log"
		done
	fi
	if ! problem=$(check_maps "$name postmaster" "$(cat "$work/maps-$name.postmaster" 2>/dev/null)") ||
		! problem=$(check_maps "$name backend" "$(cat "$work/maps-$name.backend" 2>/dev/null)"); then
		status=1
		summary+=("$name: $problem")
	elif [[ $libraries == *citus* ]] && ! grep -q '/citus\.so$' "$work/maps-$name.backend"; then
		status=1
		summary+=("$name: the backend has not mapped citus.so")
	fi
	# the nodes' logs; some tests kill processes (KILL, QUIT), none makes
	# one abort or fault
	crashed="$pattern|terminated by signal (4|6|7|8|11)"
	for log in "$tree"/tmp_check/log/*.log; do
		if grep -Eq "$crashed" "$log"; then
			reports=$((reports + 1))
			echo "-- in $log:"
			grep -E -B 2 -A 30 "$crashed" "$log"
		fi
	done
	as_runner mv "$tree/tmp_check" "$work/tmp_check-$name"
}
if wants tap; then
	run_tap tap idempotency 't/*.pl'
fi
# as scripts/test.sh does: without Citus in the server, one line says so
if wants citus; then
	if [ -e "$sharedir/extension/citus.control" ]; then
		run_tap citus citus,idempotency 't/citus/*.pl'
	else
		summary+=("citus: not run (citus is not installed in this server)")
	fi
fi

# -- 6. the reports: ASan's files (of any process), and those found above
say "look for reports"
for f in "$logs"/*; do
	[ -s "$f" ] || continue
	reports=$((reports + 1))
	echo "-- sanitizer report $f"
	cat "$f"
done
if [ $reports -ne 0 ]; then
	status=1
	summary+=("sanitizers: $reports report(s), above")
else
	summary+=("sanitizers: no report")
fi

echo
echo "== summary ($((SECONDS - started))s)"
printf '%s\n' "${summary[@]}"
if [ $status -eq 0 ]; then
	echo "check-sanitize: passed"
else
	echo "check-sanitize: FAILED"
	[ -n "${KEEP_WORKDIR:-}" ] || echo "(KEEP_WORKDIR=1 keeps $work: the build, the server log, the reports)"
fi
exit $status
