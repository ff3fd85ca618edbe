#!/usr/bin/env python3
"""
make dist: assemble the SQL edition of idempotency, dist/idempotency-sql--<version>.sql,
from the C edition's own scripts and the edition's functions in sql-edition/.

The tables, types, views, comments and grants have one source: the C
edition's scripts (idempotency--1.0.sql and the update scripts along the
path to idempotency.control's default_version).  They are taken as they are,
with these mechanical changes, each checked:

  - the "\\echo ... \\quit" guard line goes (the file is run by psql -f);
  - pg_extension_config_dump() calls go (there is no extension to dump);
  - every C function ("AS 'MODULE_PATHNAME', 'symbol' LANGUAGE C ...") is
    created with the same signature, defaults, volatility, strictness,
    parallel safety and ROWS, as a PL/pgSQL stub that raises 0A000; the two
    helpers that the C scripts call while they run (_warn_without_preload,
    _carry_grants) get the bodies in sql-edition/inline/<symbol>.sql;
  - the scripts' SELECT calls of those helpers run in DO blocks (a SELECT
    prints a row under psql -f; a good install prints nothing);
  - nothing else: any other "LANGUAGE C" or MODULE_PATHNAME is an error.

Then the edition's functions (sql-edition/*.sql, CREATE OR REPLACE FUNCTION)
replace the stubs: CREATE OR REPLACE keeps each stub's comment and grants,
and PostgreSQL refuses one whose argument names, defaults or result type
differ.  Every stub must be replaced except the functions listed in
NOT_YET (what only a C edition can do: Citus's part of the outbox); the
script says which in its header.  The whole is one transaction.

  scripts/build-sql-edition.py [--out DIR]
"""
import argparse
import textwrap
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EDITION = os.path.join(ROOT, "sql-edition")

# The edition's own sources, in the order they run (helpers first).
SOURCES = ["settings.sql", "keys.sql", "fingerprint.sql", "events.sql", "stats.sql", "outbox.sql", "maintenance.sql"]

# C functions the edition does not have yet: they stay stubs (0A000).
# _outbox_on_shard is Citus's (a distributed outbox's part on one shard),
# which a managed server without C does not have.
NOT_YET = {"_outbox_on_shard"}

C_FUNCTION = re.compile(
    r"CREATE FUNCTION idempotency\.(?P<name>\w+)\((?P<args>[^;]*?)"
    r"AS 'MODULE_PATHNAME', '(?P<symbol>\w+)'\s*\n"
    r"LANGUAGE C\b(?P<attrs>[^;]*);", re.S)


def fail(message):
    sys.exit("build-sql-edition: " + message)


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def default_version():
    m = re.search(r"^default_version\s*=\s*'([^']+)'", read(os.path.join(ROOT, "idempotency.control")), re.M)
    if not m:
        fail("idempotency.control has no default_version")
    return m.group(1)


def script_path(version):
    """The C edition's scripts from the base install to version, in order."""
    files = os.listdir(ROOT)
    bases = sorted(f for f in files if re.fullmatch(r"idempotency--[\d.]+\.sql", f))
    updates = {}
    for f in files:
        m = re.fullmatch(r"idempotency--([\d.]+)--([\d.]+)\.sql", f)
        if m:
            updates.setdefault(m.group(1), []).append((m.group(2), f))
    for base in bases:
        start = re.fullmatch(r"idempotency--([\d.]+)\.sql", base).group(1)
        # breadth first: the shortest path of updates, as CREATE EXTENSION takes
        paths = [(start, [base])]
        seen = {start}
        while paths:
            v, chain = paths.pop(0)
            if v == version:
                return chain
            for nxt, f in sorted(updates.get(v, [])):
                if nxt not in seen:
                    seen.add(nxt)
                    paths.append((nxt, chain + [f]))
    fail(f"no script path to version {version}")


def stub_body(name):
    return ("$stub$\nBEGIN\n"
            f"\tRAISE EXCEPTION '{name}() is not in the SQL edition of idempotency yet'\n"
            "\t\tUSING ERRCODE = 'feature_not_supported',\n"
            "\t\t\t  HINT = 'It needs the C edition (CREATE EXTENSION idempotency).';\n"
            "END\n$stub$")


def transform(script, text, stubs, extension=False):
    text, n = re.subn(r"^(-- complain if script is sourced in psql.*\n)?\\echo .*\\quit\n", "", text, flags=re.M)
    if n != 1:
        fail(f"{script}: expected one \\echo ... \\quit guard line, found {n}")
    if not extension:
        text = re.sub(r"^SELECT pg_catalog\.pg_extension_config_dump\([^;]*\);\n", "", text, flags=re.M)

    def replace(m):
        name, symbol, attrs = m.group("name"), m.group("symbol"), m.group("attrs")
        inline = os.path.join(EDITION, "inline", symbol + ".sql")
        if os.path.exists(inline):
            body = read(inline).strip()
        else:
            body = stub_body(name)
            stubs.append(name)
        return (f"CREATE FUNCTION idempotency.{name}({m.group('args')}"
                f"LANGUAGE plpgsql{attrs}\nAS {body};")

    text = C_FUNCTION.sub(replace, text)
    # the calls of those helpers print a result row each under psql -f: run
    # them in a DO block instead, so that a good install prints nothing
    text = re.sub(r"^SELECT (idempotency\._\w+\([^;]*\));$",
                  r"DO $call$ BEGIN PERFORM \1; END $call$;", text, flags=re.M | re.S)
    for leftover in ("MODULE_PATHNAME", "LANGUAGE C"):
        if leftover in text:
            line = text[:text.index(leftover)].count("\n") + 1
            fail(f"{script}: a {leftover} this tool does not know how to replace (near line {line})")
    return text


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(ROOT, "dist"))
    args = parser.parse_args()

    version = default_version()
    chain = script_path(version)
    stubs = []
    parts = [f"/* ---- {s} (the C edition's script, transformed) ---- */\n\n" + transform(s, read(os.path.join(ROOT, s)), stubs)
             for s in chain]
    sources = []
    for s in SOURCES:
        text = read(os.path.join(EDITION, s))
        sources.append(f"/* ---- sql-edition/{s} ---- */\n\n" + text)
    edition = "\n".join(sources)
    for name in sorted(set(stubs)):
        replaced = re.search(r"CREATE OR REPLACE FUNCTION idempotency\." + name + r"\(", edition)
        if name in NOT_YET:
            if replaced:
                fail(f"{name} is implemented in sql-edition/: take it off NOT_YET")
        elif not replaced:
            fail(f"the C function {name} has no implementation in sql-edition/ (nor is it in NOT_YET)")
    missing = sorted(NOT_YET - set(stubs))
    if missing:
        fail(f"NOT_YET names functions the C scripts do not create: {', '.join(missing)}")

    not_yet = "\n * ".join(textwrap.wrap(", ".join(sorted(NOT_YET)), 72))
    header = f"""/*
 * idempotency {version}, the SQL edition: PL/pgSQL and SQL only, for servers
 * where the C edition cannot be installed (no superuser, no C library, no
 * shared_preload_libraries).  Generated by scripts/build-sql-edition.py
 * (make dist) from {', '.join(chain)}
 * and sql-edition/; do not edit.
 *
 * Install as a role that holds CREATE on the database (it becomes the owner
 * of schema idempotency and everything in it):
 *
 *     psql -v ON_ERROR_STOP=1 -f idempotency-sql--{version}.sql
 *
 * It runs in one transaction: it installs everything or nothing, and refuses
 * to run where schema idempotency already exists.
 *
 * This version has the idempotency keys, consumer deduplication,
 * fingerprints, the outbox (enqueue, routes, the pull API) and
 * idem_run_maintenance() (the purge, and publishing of the routes SQL can
 * serve), which pg_cron or the application's scheduler calls.  These
 * functions raise 0A000: {not_yet}.
 * How the editions differ: doc/internals.md.
 */

BEGIN;

DO $guard$
BEGIN
	IF EXISTS (SELECT FROM pg_catalog.pg_namespace WHERE nspname = 'idempotency') THEN
		RAISE EXCEPTION 'schema "idempotency" already exists'
			USING ERRCODE = 'duplicate_schema',
				  DETAIL = format('It holds %s.', coalesce(pg_catalog.obj_description('idempotency'::regnamespace, 'pg_namespace'),
														  'objects of another install (the C edition, or another application)')),
				  HINT = 'This script installs the SQL edition of idempotency {version} where it is not installed; nothing was changed.';
	END IF;
END
$guard$;

CREATE SCHEMA idempotency;
COMMENT ON SCHEMA idempotency IS 'idempotency {version} (SQL edition)';
"""
    footer = """
/*
 * The edition's own helpers are revoked from PUBLIC like everything else
 * (the C scripts' REVOKE ran before they existed).
 */
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idempotency FROM PUBLIC;

COMMIT;
"""
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, f"idempotency-sql--{version}.sql")
    with open(out + ".tmp", "w", encoding="utf-8") as f:
        f.write(header + "\n" + "\n".join(parts) + "\n" + edition + footer)
    os.replace(out + ".tmp", out)
    print(out)

    # The same objects as an extension script for pg_tle: CREATE EXTENSION
    # creates the schema and runs it in its own transaction; the tables are
    # the extension's configuration tables again (pg_dump dumps their rows).
    ext_parts = [f"/* ---- {s} (the C edition's script, transformed) ---- */\n\n"
                 + transform(s, read(os.path.join(ROOT, s)), [], extension=True) for s in chain]
    ext_script = (f"COMMENT ON SCHEMA idempotency IS 'idempotency {version} (SQL edition, pg_tle)';\n\n"
                  + "\n".join(ext_parts) + "\n" + edition
                  + footer.replace("\nCOMMIT;\n", ""))
    out = os.path.join(args.out, f"idempotency-pgtle--{version}.sql")
    with open(out + ".tmp", "w", encoding="utf-8") as f:
        f.write(pgtle_script(version, ext_script, read(os.path.join(ROOT, "idempotency.control")), chain))
    os.replace(out + ".tmp", out)
    print(out)


# pg_tle keeps an extension's script inside a function it creates, quoted
# with these two delimiters, and refuses a script that holds either.
PGTLE_FORBIDDEN = ("$_pgtle_o_$", "$_pgtle_i_$")
PGTLE_QUOTE = "$_idempotency_$"


def pgtle_script(version, ext_script, control, chain):
    """dist/idempotency-pgtle--<version>.sql: the edition registered with
    pg_tle (pgtle.install_extension), so that CREATE EXTENSION idempotency
    installs it.  pg_tle runs an extension script without transaction
    control and refuses its own quoting delimiters in it; the script is
    passed dollar-quoted with a delimiter it must not contain either.
    Later versions add pgtle.install_update_path calls, one per SQL-edition
    update script, once the edition has them (it has none yet)."""
    for bad in PGTLE_FORBIDDEN + (PGTLE_QUOTE,):
        if bad in ext_script:
            fail(f"the extension script holds {bad}, which the pg_tle file cannot quote")
    m = re.search(r"^\s*(BEGIN|COMMIT|ROLLBACK|START TRANSACTION)\s*;", ext_script, re.M | re.I)
    if m:
        fail(f"the extension script holds transaction control ({m.group(1)}), which pg_tle refuses")
    comment = re.search(r"^comment\s*=\s*'((?:[^']|'')*)'", control, re.M)
    schema = re.search(r"^schema\s*=\s*(\w+)", control, re.M)
    if not comment or not schema:
        fail("idempotency.control has no comment or schema")
    description = comment.group(1).replace("''", "'") + " (SQL edition)"
    return f"""/*
 * idempotency {version}, the SQL edition, for pg_tle (Trusted Language
 * Extensions: Amazon RDS and Aurora, Supabase).  Generated by
 * scripts/build-sql-edition.py (make dist) from {', '.join(chain)}
 * and sql-edition/; do not edit.  The same objects as
 * idempotency-sql--{version}.sql, as an extension.
 *
 * Register it once per database, as a role that holds pgtle_admin (and, to
 * create the extension, CREATE on the database), where pg_tle is installed
 * (CREATE EXTENSION pg_tle, with pg_tle in shared_preload_libraries):
 *
 *     psql -v ON_ERROR_STOP=1 -f idempotency-pgtle--{version}.sql
 *     psql -c 'CREATE EXTENSION idempotency'
 *
 * It is one statement: it registers the edition or nothing.  Running it
 * again is refused by pg_tle (the extension is registered, or installed,
 * already); SELECT pgtle.uninstall_extension('idempotency') takes the
 * registration back once DROP EXTENSION idempotency has run.
 */

SELECT pgtle.install_extension(
	'idempotency',
	'{version}',
	{sql_literal(description)},
{PGTLE_QUOTE}
{ext_script}{PGTLE_QUOTE},
	ARRAY[]::text[],
	'{schema.group(1)}');
"""


def sql_literal(text):
    return "'" + text.replace("'", "''") + "'"


if __name__ == "__main__":
    main()
