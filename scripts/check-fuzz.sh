#!/usr/bin/env bash
#
# make check-fuzz (SUITES=fuzz make test): two fuzzers against a temporary
# server that preloads the library (scripts/with-server.sh), bounded to about
# a minute and a half in all on two cores:
#
#   1. test/fuzz/fuzz_args.py, the project's own argument fuzzer: every
#      function of the extension with hostile arguments in every position,
#      in every kind of transaction, and races between 2 to 4 sessions on a
#      few shared keys (see its docstring).  FUZZ_SEED, FUZZ_CALLS.
#   2. Debian's sqlsmith: random queries over the extension's tables, view
#      and functions, in a database with rows of every kind (test/fuzz/
#      setup.sql) and views that call the functions over those rows
#      (test/fuzz/sqlsmith-views.sql), as a role with the README's grants
#      (not a superuser: its random calls of server functions stay
#      harmless).  Every query runs in a transaction that sqlsmith rolls
#      back.  SQLSMITH_SEED, SQLSMITH_QUERIES.
#
# The suite fails when a backend crashed or the server restarted (a lost
# connection; a server log line saying "terminated by signal", "was
# terminated", PANIC or "TRAP:"), or on an internal error (XX000-XX002) of a
# call of the extension.  Ordinary errors are expected and only counted.
# Both seeds are printed: the same seeds run the same calls and queries.
#
# As root, it installs what is missing (sqlsmith, python3-psycopg; scripts/
# deps.sh should list them too) and runs the rest as the runner in a scratch
# copy of the tree, as scripts/test.sh does; as anyone else it needs them
# installed, and a tree it can write.
#
#   scripts/check-fuzz.sh --with-server
#
# runs both against the server that PGHOST, PGPORT and PGUSER (a superuser)
# name, whose log is FUZZ_SERVER_LOG (default: scripts/with-server.sh's,
# ./tmp_check_server/server.log).  That is how with-server.sh calls it; it
# suits a temporary server only (another build of the library, say): it sets
# log_line_prefix and log_error_verbosity with ALTER SYSTEM, and drops and
# creates the databases idem_fuzz, idem_smith and idem_smith_log.
#
set -uo pipefail
cd "$(dirname "$0")/.."

. scripts/common.sh

# Debian's sqlsmith and psycopg 3 for the system python3: scripts/deps.sh
# installs them as root (with the rest of make test's packages); anyone else
# is told what to install
prerequisites() {
	if [ "$(id -u)" -eq 0 ]; then
		scripts/deps.sh
	elif ! command -v sqlsmith >/dev/null || ! /usr/bin/python3 -c 'import psycopg' 2>/dev/null; then
		echo "check-fuzz: sqlsmith or python3-psycopg is missing: run make test as root, or apt-get install sqlsmith python3-psycopg" >&2
		return 1
	fi
}

if [ "${1:-}" = --with-server ]; then
	# ---- inside scripts/with-server.sh: PGHOST, PGPORT, PGUSER are set ----
	prerequisites || exit 1
	log=${FUZZ_SERVER_LOG:-$PWD/tmp_check_server/server.log}
	[ -r "$log" ] || { echo "check-fuzz: cannot read the server log $log (FUZZ_SERVER_LOG)" >&2; exit 1; }
	psql() { "$PGBIN/psql" -X -q -v ON_ERROR_STOP=1 "$@"; }
	use_server
	# %e: the SQLSTATE of each logged error, so that an internal error of
	# the background worker shows in the log too; verbose: where each error
	# was raised (LOCATION), to tell the extension's internal errors from
	# the server's own
	psql -d postgres -c "ALTER SYSTEM SET log_line_prefix = '%m [%p] %e '" \
		-c "ALTER SYSTEM SET log_error_verbosity = verbose" \
		-c "SELECT pg_reload_conf()" >/dev/null || exit 1
	status=0

	echo "== argument fuzzer (test/fuzz/fuzz_args.py)"
	# one "ok:" or "FAILED:" line per fuzzer: make test's summary counts them
	if FUZZ_SERVER_LOG=$log nice -n 10 /usr/bin/python3 test/fuzz/fuzz_args.py; then
		echo "ok: argument fuzzer"
	else
		echo "FAILED: argument fuzzer"
		status=1
	fi

	echo
	echo "== sqlsmith"
	queries=${SQLSMITH_QUERIES:-5000}
	seed=${SQLSMITH_SEED:-$((RANDOM * 32768 + RANDOM + 1))}
	psql -d postgres -c "SET client_min_messages = warning" \
		-c "DROP DATABASE IF EXISTS idem_smith WITH (FORCE)" -c "CREATE DATABASE idem_smith" \
		-c "DROP DATABASE IF EXISTS idem_smith_log WITH (FORCE)" -c "CREATE DATABASE idem_smith_log" || exit 1
	psql -d idem_smith -c "SET client_min_messages = warning" -f test/fuzz/setup.sql \
		-f test/fuzz/sqlsmith-views.sql >/dev/null || exit 1
	psql -d idem_smith -c "ALTER DATABASE idem_smith SET track_functions = 'all'" || exit 1
	psql -d idem_smith_log -f test/fuzz/sqlsmith-log.sql || exit 1
	started=$(psql -At -d postgres -c "SELECT pg_postmaster_start_time()")
	offset=$(stat -c %s "$log")
	echo "sqlsmith: seed $seed (SQLSMITH_SEED), $queries queries (SQLSMITH_QUERIES), database idem_smith as idem_fuzz_app"
	out=$(mktemp)
	trap 'rm -f "$out"' EXIT
	t0=$SECONDS
	nice -n 10 timeout 300 sqlsmith --verbose --exclude-catalog \
		--seed="$seed" --max-queries="$queries" \
		--target="host=$PGHOST port=$PGPORT dbname=idem_smith user=idem_fuzz_app" \
		--log-to="host=$PGHOST port=$PGPORT dbname=idem_smith_log user=$PGUSER" \
		>/dev/null 2>"$out"
	rc=$?
	elapsed=$((SECONDS - t0))
	# after a crash, the server takes a moment to be back
	for _ in $(seq 60); do
		psql -d postgres -c "SELECT 1" >/dev/null 2>&1 && break
		sleep 0.5
	done

	# sqlsmith reports how many queries it ran; each error is a row of
	# idem_smith_log.error, with its SQLSTATE
	ran=$(grep -E '^queries: ' "$out" | tail -n 1 | awk '{print $2}')
	psql -At -d idem_smith_log -c "
		SELECT 'sqlsmith: exit status $rc, ${ran:-?} queries in ${elapsed} s, '
		       || count(*) || ' errors (' || count(*) FILTER (WHERE sqlstate = '57014')
		       || ' statement timeouts, ' || count(*) FILTER (WHERE coalesce(sqlstate, '') IN ('', '57P01', '57P02', '57P03'))
		       || ' broken connections)'
		FROM error"
	echo "errors per SQLSTATE class (most frequent codes):"
	psql -At -d idem_smith_log -c "
		WITH codes AS (SELECT coalesce(sqlstate, '?????') AS code, count(*) AS n FROM error GROUP BY 1),
		     ranked AS (SELECT left(code, 2) AS class, code, n,
		                       row_number() OVER (PARTITION BY left(code, 2) ORDER BY n DESC, code) AS r
		                FROM codes)
		SELECT '  ' || rpad(class, 4) || lpad(sum(n)::text, 6) || '  ('
		       || string_agg(code || ' ' || n, ', ' ORDER BY n DESC, code) FILTER (WHERE r <= 4)
		       || CASE WHEN count(*) > 4 THEN ', ...)' ELSE ')' END
		FROM ranked GROUP BY class ORDER BY class"
	echo "calls of the extension's functions in sqlsmith's queries (pg_stat_user_functions):"
	psql -At -d idem_smith -c "SELECT pg_stat_force_next_flush()" \
		-c "SELECT '  ' || coalesce(string_agg(replace(funcid::regprocedure::text, 'idempotency.', '')
		                                       || ' ' || calls, ', ' ORDER BY calls DESC), 'none')
		    FROM pg_stat_user_functions WHERE schemaname = 'idempotency' AND calls > 0" 2>/dev/null |
		tail -n 1 | fold -s -w 96 | sed '2,$s/^/    /'

	findings=0
	# internal errors raised by the extension's code: the LOCATION of an
	# XX00x error (log_error_verbosity = verbose) is a function defined in
	# one of src/**/*.c (core has a guc.c and a shmem.c too, hence the function)
	internal=$(tail -c +"$((offset + 1))" "$log" |
		sed -n 's/.*\] XX00[0-2] LOCATION:  \([A-Za-z0-9_]*\), \([A-Za-z0-9_]*\.c\):[0-9]*$/\1 \2/p' |
		sort | uniq -c | while read -r n func file; do
			path=$(find src -name "$file" -print -quit)
			[ -n "$path" ] && grep -q "^$func(" "$path" && echo "$n $func $path"
		done)
	if [ -n "$internal" ]; then
		findings=$((findings + 1))
		echo "!! finding: internal errors raised by the extension (seed $seed; count, function, file):"
		printf '%s\n' "$internal" | sed 's/^/  /'
		for func in $(printf '%s\n' "$internal" | awk '{print $2}'); do
			echo "  -- the first one in $func, with its query (the reproduction):"
			# a log entry: its first line, then its DETAIL, LOCATION,
			# STATEMENT... lines and their continuations
			tail -c +"$((offset + 1))" "$log" | awk -v fn="$func" '
				/^[0-9-]+ [0-9:.]+ [A-Z]+ \[[0-9]+\] / &&
				!/ (DETAIL|HINT|CONTEXT|LOCATION|STATEMENT|QUERY):  / {
					if (found) exit
					entry = ""
				}
				{ entry = entry "  " $0 "\n" }
				index($0, "LOCATION:  " fn ",") { found = 1 }
				END { if (found) printf "%s", entry }' | head -n 60
		done
	fi
	other=$(psql -At -d idem_smith_log -c "SELECT count(*) FROM error WHERE sqlstate LIKE 'XX%'")
	[ "${other:-0}" -gt 0 ] && [ -z "$internal" ] &&
		echo "(note: $other internal error(s) raised by the server's own code, not the extension's:" \
			"$(psql -At -d idem_smith_log -c "SELECT string_agg(DISTINCT regexp_replace(split_part(msg, E'\n', 1), '^ERROR:  ', ''), '; ')
			                                  FROM error WHERE sqlstate LIKE 'XX%'"))"
	# a crash: in the log (a backend's crash restarts the server's processes
	# but not the postmaster, so its start time only shows a full restart),
	# or a restarted or vanished server
	crashes=$(tail -c +"$((offset + 1))" "$log" |
		grep -E 'terminated by signal|was terminated|PANIC:|^TRAP:|reinitializing' | grep -v -E '^\s|STATEMENT:  ')
	if [ -n "$crashes" ]; then
		findings=$((findings + 1))
		echo "!! finding: the server log says (seed $seed):"
		printf '%s\n' "$crashes" | head -n 20 | sed 's/^/  /'
		echo "  the query of the process that crashed (the reproduction):"
		tail -c +"$((offset + 1))" "$log" | awk '
			/Failed process was running: / { on = 1; n++; if (n > 2) exit; print "  " $0; next }
			on && /^[ \t]/ { print "  " $0; next }
			{ on = 0 }' | head -n 80
	fi
	now=$(psql -At -d postgres -c "SELECT pg_postmaster_start_time()" 2>/dev/null)
	if [ "$now" != "$started" ]; then
		findings=$((findings + 1))
		echo "!! finding: the server restarted or is gone (started $started, now ${now:-unreachable})"
	fi
	if [ "$rc" -ne 0 ]; then
		findings=$((findings + 1))
		echo "!! sqlsmith failed (exit status $rc); the end of its output:"
		tail -n 15 "$out"
	fi
	if [ "$findings" -eq 0 ]; then
		echo "sqlsmith: no crash"
		echo "ok: sqlsmith"
	else
		echo "FAILED: sqlsmith"
		status=1
	fi
	exit $status
fi

# ---- outside: prerequisites, then the server ----
prerequisites || exit 1

if [ "$(id -u)" -eq 0 ]; then
	# initdb refuses root: run as the runner, in a copy of the tree it owns
	use_server
	work=$(runner_tmpdir fuzz)
	trap 'rm -rf "$work"' EXIT
	tar --exclude=./.git --exclude='./tmp_check*' -cf - . | tar -C "$work" -xf -
	chown -R "$RUN_AS" "$work"
	as_runner env PG_CONFIG="$PG_CONFIG" "$work/scripts/check-fuzz.sh"
	exit $?
fi

exec scripts/with-server.sh "$PWD/scripts/check-fuzz.sh" --with-server
