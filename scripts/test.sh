#!/usr/bin/env bash
#
# make test: install what is missing, build with warnings as errors, install,
# check the include graph of src/ (make include-graph: no cycle), then run
# every suite against temporary instances that preload the library:
#
#   installcheck  make installcheck's pg_regress (sql/ against expected/)
#               and pg_isolation_regress (specs/ against expected/), against
#               a temporary server that preloads the library, as a user's
#               existing server would (scripts/with-server.sh)
#   tap         prove, t/*.pl with PostgreSQL::Test::Cluster
#   citus       prove, t/citus/*.pl: a Citus coordinator and two workers,
#               when the citus extension is installed in the server tree
#               (one line of the summary says so when it is not)
#   examples    clients/*/test.sh and examples/*/test.sh: real clients over real connections,
#               directly and through pgbouncer (scripts/test-examples.sh)
#   fuzz        hostile arguments to every function, and Debian's sqlsmith,
#               bounded to about two minutes (scripts/check-fuzz.sh)
#   docs        every ```sql example of README.md and doc/, run in a fresh
#               database per file (scripts/check-docs.sh)
#   sql-edition the SQL edition (make dist), installed by a role without
#               superuser on a server without the C library; its catalog
#               against the C edition's, and the key and event suites
#               against it, with sql-edition/differences.patch
#               (scripts/check-sql-edition.sh)
#   pgtle       the same, the edition registered with pg_tle and created
#               with CREATE EXTENSION by a role holding pgtle_admin, when
#               pg_tle is installed in the server tree (one line of the
#               summary says so when it is not; doc/testing.md)
#
# Every suite runs even when an earlier one fails; the summary at the end
# lists each, and the exit status is non-zero if any failed.  SUITES picks a
# subset, e.g. SUITES="regress isolation" make test; KEEP_WORKDIR=1 keeps
# the tree the suites ran in, with their results, for a look afterwards.
# SUITES may also name "regress" and "isolation": the same two suites, each
# on a temporary instance of pg_regress's own.  The server version is
# scripts/common.sh's pick: PG_MAJOR=NN or PG_CONFIG=… choose another.
#
set -uo pipefail
cd "$(dirname "$0")/.."

. scripts/common.sh
scripts/deps.sh || exit 1
use_server

echo "== build and install (PostgreSQL $("$PG_CONFIG" --version | awk '{print $2}'))"
build_and_install || exit 1
# no include cycle between the modules, nothing exported that one uses
python3 scripts/include-graph.py --quiet || exit 1

# The suites write results and temporary instances next to the tests, so
# they run in a copy of the tree that the runner owns.
work=$(runner_tmpdir test)
if [ -n "${KEEP_WORKDIR:-}" ]; then
	echo "(keeping the test tree: $work)"
else
	trap 'rm -rf "$work"' EXIT
fi
tar --exclude=./.git --exclude='./tmp_check*' --exclude=./results --exclude=./output_iso \
	--exclude=node_modules --exclude=./dist \
	-cf - . | tar -C "$work" -xf -
[ "$(id -u)" -eq 0 ] && chown -R "$RUN_AS" "$work"

summary=()
status=0
for suite in ${SUITES:-installcheck tap citus examples fuzz docs sql-edition pgtle}; do
	echo
	echo "== $suite"
	# the Citus suite needs Citus in the server tree, which Debian does not ship
	if [ "$suite" = citus ] &&
		[ ! -e "$("$PG_CONFIG" --sharedir)/extension/citus.control" ]; then
		summary+=("citus suite: not run (citus is not installed in this server)")
		echo "${summary[-1]}"
		continue
	fi
	# nor pg_tle
	if [ "$suite" = pgtle ] &&
		[ ! -e "$("$PG_CONFIG" --sharedir)/extension/pg_tle.control" ]; then
		summary+=("pgtle suite: not run (pg_tle is not installed in this server: see doc/testing.md)")
		echo "${summary[-1]}"
		continue
	fi
	if as_runner make -C "$work" --no-print-directory PG_CONFIG="$PG_CONFIG" "check-$suite"; then
		summary+=("$suite: passed")
	else
		status=1
		summary+=("$suite: FAILED")
		for diffs in "$work/regression.diffs" "$work/output_iso/regression.diffs"; do
			[ -s "$diffs" ] && { echo "-- $diffs"; cat "$diffs"; }
		done
		if [[ $suite == tap || $suite == citus ]] && [ -d "$work/tmp_check/log" ]; then
			for log in "$work"/tmp_check/log/regress_log_*; do
				echo "-- $log (last 60 lines)"
				tail -n 60 "$log"
			done
		fi
	fi
done

echo
echo "== summary"
printf '%s\n' "${summary[@]}"
exit $status
