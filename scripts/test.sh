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
# lists each with its counts, then the totals alone on a line, "N passed,
# M failed, K skipped" (CI reads that line), and the exit status is non-zero
# if any failed.  What is counted, per suite:
#   installcheck, regress, isolation, sql-edition, pgtle: pg_regress's tests and isolation
#               specs (a file of sql/ or specs/ each), from their summaries
#   tap, citus  test files (t/*.pl, t/citus/*.pl), from prove's summary; a
#               file that skips itself (a tool missing) is skipped, and a
#               suite that does not run counts its files as skipped
#   examples    runs of a client or example: each, directly and through
#               pgbouncer (its "ok:" or "FAILED:" line)
#   fuzz        fuzzers: the argument fuzzer and sqlsmith
#   docs        documents: README.md and each doc/**/*.md
#   any other   the suite itself, as one
# A suite that fails without reaching its summary counts one failure.  SUITES picks a
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
fi
trap '[ -n "${KEEP_WORKDIR:-}" ] || rm -rf "$work"' EXIT
tar --exclude=./.git --exclude='./tmp_check*' --exclude=./results --exclude=./output_iso \
	--exclude=node_modules --exclude=./dist \
	-cf - . | tar -C "$work" -xf -
[ "$(id -u)" -eq 0 ] && chown -R "$RUN_AS" "$work"

# count_prove LOG: sets passed, failed and skipped from prove's summary in
# LOG: "Files=15, Tests=312, ..." and, under "Test Summary Report", a line
# per failed file: "t/003_x.pl   (Wstat: 512 (exited 2) ...)"
count_prove() {
	local files
	files=$(sed -n 's/^Files=\([0-9]*\),.*/\1/p' "$1" | tail -n 1)
	failed=$(grep -Ec '^t/[^ ]*\.pl +\(Wstat: ' "$1")
	skipped=$(grep -Ec '^t/[^ ]*\.pl \.* ?skipped' "$1")
	passed=$((${files:-0} - failed - skipped))
	[ "$passed" -ge 0 ] || passed=0
}

# count_suite SUITE LOG STATUS: sets passed, failed and skipped from the
# suite's output (see the top of this file)
count_suite() {
	local suite=$1 log=$2 status=$3 files
	passed=0 failed=0 skipped=0
	case $suite in
	installcheck | regress | isolation | sql-edition | pgtle)
		# (the sql-edition suite's TAP files too, from prove's summary)
		[ "$suite" = sql-edition ] && count_prove "$log"
		local tap_passed=$passed tap_failed=$failed
		# "All 17 tests passed.", "2 of 17 tests failed." (15: with a
		# leading space; 16 and later: after "# ")
		read -r passed failed < <(awk '
			match($0, /All [0-9]+ tests passed/) { split(substr($0, RSTART), w, " "); p += w[2] }
			match($0, /[0-9]+ of [0-9]+ tests failed/) { split(substr($0, RSTART), w, " "); f += w[1]; p += w[3] - w[1] }
			END { print p + 0, f + 0 }' "$log")
		passed=$((passed + ${tap_passed:-0})) failed=$((failed + ${tap_failed:-0}))
		;;
	tap | citus)
		count_prove "$log"
		;;
	examples)
		passed=$(grep -Ec '^ok: (clients|examples)/' "$log")
		failed=$(grep -Ec '^FAILED: (clients|examples)/' "$log")
		;;
	fuzz)
		passed=$(grep -Ec '^ok: (argument fuzzer|sqlsmith)$' "$log")
		failed=$(grep -Ec '^FAILED: (argument fuzzer|sqlsmith)$' "$log")
		;;
	docs)
		passed=$(grep -Ec '^ok: [^ ]+\.md ' "$log")
		failed=$(grep -Ec '^FAILED: [^ ]+\.md' "$log")
		;;
	*)
		# a suite without counts of its own counts as one
		[ "$status" -eq 0 ] && passed=1
		;;
	esac
	# failed without saying what: one failure
	if [ "$status" -ne 0 ] && [ "$failed" -eq 0 ]; then
		failed=1
	fi
	return 0
}

logs=$(mktemp -d)
trap 'rm -rf "$logs"; [ -n "${KEEP_WORKDIR:-}" ] || rm -rf "$work"' EXIT
summary=()
status=0
total_passed=0 total_failed=0 total_skipped=0
for suite in ${SUITES:-installcheck tap citus examples fuzz docs sql-edition pgtle}; do
	echo
	echo "== $suite"
	# the Citus suite needs Citus in the server tree, which Debian does not ship
	if [ "$suite" = citus ] &&
		[ ! -e "$("$PG_CONFIG" --sharedir)/extension/citus.control" ]; then
		skipped=$(ls t/citus/*.pl | wc -l)
		total_skipped=$((total_skipped + skipped))
		summary+=("citus: not run, $skipped test files skipped: Citus is not installed in this server (Debian does not package it; doc/integrations/citus.md says how to get it)")
		echo "${summary[-1]}"
		continue
	fi
	# nor pg_tle
	if [ "$suite" = pgtle ] &&
		[ ! -e "$("$PG_CONFIG" --sharedir)/extension/pg_tle.control" ]; then
		total_skipped=$((total_skipped + 1))
		summary+=("pgtle: not run, 1 suite skipped: pg_tle is not installed in this server (Debian does not package it; doc/testing.md says how to get it)")
		echo "${summary[-1]}"
		continue
	fi
	as_runner make -C "$work" --no-print-directory PG_CONFIG="$PG_CONFIG" "check-$suite" 2>&1 |
		tee "$logs/$suite"
	suite_status=${PIPESTATUS[0]}
	count_suite "$suite" "$logs/$suite" "$suite_status"
	total_passed=$((total_passed + passed))
	total_failed=$((total_failed + failed))
	total_skipped=$((total_skipped + skipped))
	counts="$passed passed, $failed failed"
	[ "$skipped" -gt 0 ] && counts+=", $skipped skipped"
	if [ "$suite_status" -eq 0 ]; then
		summary+=("$suite: passed ($counts)")
	else
		status=1
		summary+=("$suite: FAILED ($counts)")
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
echo "$total_passed passed, $total_failed failed, $total_skipped skipped"
exit $status
