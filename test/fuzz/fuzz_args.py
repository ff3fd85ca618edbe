#!/usr/bin/env python3
"""Argument fuzzer for the idempotency extension (part of make check-fuzz).

Why
---
Every SQL function of the extension is C code, and most of it reads and
writes the extension's tables directly (heap and index access, a custom scan
for idem_claim).  A NULL, a length, an overflow or a state that the C code
does not expect is then not a clean ERROR but a crash of the backend (and a
restart of the whole server), a PANIC, or an internal error (SQLSTATE XX000,
"cache lookup failed", "invalid memory alloc request size", ...).  The
regression suites check the documented cases; this fuzzer throws everything
else at the functions, within a bounded number of calls, and fails only on
what must never happen.

What it does
------------
It creates a database (FUZZ_DB, default idem_fuzz: dropped and created anew)
with the extension, roles, helper functions and rows of every kind
(test/fuzz/setup.sql), then makes FUZZ_CALLS calls in three phases:

1. sweep: each hostile value of each argument kind (the hostile_* functions
   below), in each argument position of each function (the FUNCTIONS table),
   once, with the other arguments valid so that the hostile one gets past
   their checks to the code behind them; plus every function with all its
   arguments NULL.  The call form rotates: SELECT f(...), SELECT * FROM
   f(...), the generic plan of a prepared statement (parameters, not
   constants), and for the functions used in FROM also EXPLAIN, EXPLAIN
   ANALYZE, (f(...)).*, a LATERAL rescan and a scrollable cursor fetched
   forwards and backwards.
2. random: random functions with a random mix of valid and hostile
   arguments, as the superuser, as a role with the README's grants, or as a
   role with none, in random transaction contexts: autocommit, a committed
   or rolled back transaction, READ ONLY, REPEATABLE READ and SERIALIZABLE
   (with the key claimed by another session after the snapshot), a
   savepoint rolled back to, and a hostile value of one of the extension's
   settings (set_config(..., true)).
3. races: random sequences of claim / complete / release / checkpoint /
   takeover (a short lease, a wait, another session's claim), marks and
   outbox calls on a small shared set of keys, from 2 to 4 sessions at once,
   inside transactions of every isolation level, READ ONLY ones and
   savepoints.  A statement that waits for another session's transaction
   (idem_complete behind a takeover, a duplicate mark, an enqueue of the
   same key) is left waiting while the others go on.

Ordinary ERRORs are expected outcomes: they are counted per SQLSTATE class.
Findings, which make the exit status 1:

  - any XX000, XX001 or XX002 SQLSTATE;
  - a lost connection (the backend died, or the server restarted);
  - a line of the server log (FUZZ_SERVER_LOG, read from where it ended when
    the run started) saying "terminated by signal", "was terminated",
    PANIC or "TRAP:", or, when log_line_prefix has %e after "[%p] "
    (check-fuzz.sh sets '%m [%p] %e '), an XX00x error of a process that is
    not one of the fuzzer's sessions (the background worker).

Each finding is printed with a reproduction: the statements that led to it,
shrunk where possible by replaying smaller sets on a fresh session, and the
seed.  The run is seeded (FUZZ_SEED, or a random seed, printed first): for
one seed, the sweep and the random phase make the same calls in the same
order; the races make the same choices too, but what they run into depends
on timing.  The fuzzer never touches the extension's tables other than
through its functions, and never alters them.

Environment: libpq's PGHOST, PGPORT and PGUSER (a superuser), FUZZ_SEED,
FUZZ_CALLS (default 15000, about 50 s on two busy cores), FUZZ_DB, FUZZ_SERVER_LOG, FUZZ_MAX_SECONDS (a
guard: the phases stop early past it, default 240), FUZZ_VERBOSE=1 (print
every statement and its outcome).
"""

import asyncio
import collections
import os
import random
import re
import sys
import time

import psycopg

SEED = int(os.environ.get("FUZZ_SEED") or random.SystemRandom().randrange(1, 2**31))
CALLS = int(os.environ.get("FUZZ_CALLS") or 15000)
DB = os.environ.get("FUZZ_DB") or "idem_fuzz"
SERVER_LOG = os.environ.get("FUZZ_SERVER_LOG") or ""
MAX_SECONDS = float(os.environ.get("FUZZ_MAX_SECONDS") or 240)
VERBOSE = bool(os.environ.get("FUZZ_VERBOSE"))
SETUP_SQL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "setup.sql")

APP_ROLE = "idem_fuzz_app"  # the README's app, relay and ops grants
NO_ROLE = "idem_fuzz_none"  # no grant at all
INTERNAL_ERRORS = ("XX000", "XX001", "XX002")


def lit(s):
    """A text literal, in plain ASCII: E'...' with escapes for the rest."""
    out = []
    for ch in s:
        o = ord(ch)
        if ch == "'":
            out.append("''")
        elif ch == "\\":
            out.append("\\\\")
        elif 0x20 <= o < 0x7F:
            out.append(ch)
        elif o < 0x80:
            out.append("\\x%02x" % o)
        elif o <= 0xFFFF:
            out.append("\\u%04x" % o)
        else:
            out.append("\\U%08x" % o)
    return "E'" + "".join(out) + "'"


# ---------------------------------------------------------------------------
# Hostile values: one function per kind, each a list of SQL expressions.  The
# call builder casts each argument to the parameter's type.  Large values are
# expressions (repeat(...)) so that statements stay short in the server log.
# ---------------------------------------------------------------------------

EURO, GRIN, E_ACUTE = "\u20ac", "\U0001F600", "\u00e9"  # 3, 4 and 2 bytes


def hostile_strings():
    """Text of every length around the 255-byte limits, multibyte text
    straddling them, and odd characters (text cannot hold NUL itself)."""
    return [
        "NULL", "''", "'a'", "' '",
        "repeat('x', 254)", "repeat('x', 255)", "repeat('x', 256)",
        "repeat('x', 1000000)",
        f"repeat('x', 252) || {lit(EURO)}",   # 255 bytes
        f"repeat('x', 253) || {lit(EURO)}",   # 256 bytes
        f"repeat('x', 251) || {lit(GRIN)}",   # 255 bytes
        f"repeat('x', 252) || {lit(GRIN)}",   # 256 bytes
        f"repeat({lit(EURO)}, 85)",           # 255 bytes, 85 characters
        f"repeat({lit(EURO)}, 86)",           # 258 bytes
        f"repeat({lit(GRIN)}, 63)",           # 252 bytes
        f"repeat({lit(GRIN)}, 64)",           # 256 bytes
        f"repeat({lit(E_ACUTE)}, 127) || 'x'",  # 255 bytes
        f"repeat({lit(E_ACUTE)}, 128)",       # 256 bytes, 128 characters
        f"repeat({lit(GRIN)}, 250000)",       # 1,000,000 bytes
        lit("\x01"), f"repeat({lit(chr(1))}, 255)", f"repeat({lit(chr(1))}, 256)",
        lit("\x7f"), lit("\t\n\r"), lit("\\"), lit("'"), lit('"'), lit("%s%n%%"),
        lit("*"), lit(" k "), lit("\u00a0"), lit("\ufeff"), lit("\uffff"),
        lit("\U0010ffff"), lit("\u202e"), lit("e\u0301"), lit("\x1b[31m"),
        lit("\\x00"), lit("\\u0000"), lit("NULL"), lit("a.b"), lit("k\x01"),
    ]


def hostile_intervals(server_version):
    """Every edge of interval: zero, one microsecond either side, calendar
    units that compare equal to zero, the largest and smallest values."""
    values = [
        "NULL", "'0'", "'-1 us'", "'1 us'", "'1 ms'", "'1 mon'", "'-1 mon'", "'1 day'",
        "'1 mon -30 days'", "'1 mon -31 days'", "'-1 mon 40 days'", "'1 day -86400 s'",
        "'23:59:59.999999'", "'1000000 years'", "'-1000000 years'",
        "'178000000 years'", "'-178000000 years'",
        "'9223372036854775807 us'", "'-9223372036854775808 us'",  # int64 microseconds
        "'2147483647 days'", "'-2147483648 days'",
        "'2147483647 mons'", "'-2147483648 mons'",
    ]
    if server_version >= 170000:  # infinite intervals are new in 17
        values += ["'infinity'", "'-infinity'"]
    return values


def hostile_status_codes():
    """HTTP status codes at and past 100..599, the transient ones, int4's ends."""
    return ["NULL", "-2147483648", "-1", "0", "99", "100", "101", "199", "200", "204",
            "408", "425", "429", "499", "500", "599", "600", "2147483647"]


def hostile_attempts():
    """Fencing tokens at and past their limits."""
    return ["NULL", "-2147483648", "-1", "0", "1", "2", "2147483647"]


def hostile_counts():
    """Batch sizes at and past their limits."""
    return ["NULL", "-2147483648", "-1", "0", "1", "2", "1000000", "2147483647"]


def hostile_jsonb():
    """Scalars, odd numbers and escapes, duplicate keys, 5000-level nesting
    (and nesting past the server's stack depth), several MB of JSON, sizes
    around the 8000-byte NOTIFY limit."""
    return [
        "NULL", "'null'", "'{}'", "'[]'", "'\"\"'", "'0'", "'-0'", "'1e1000'", "'-1e-1000'",
        "'123456789012345678901234567890.123456789'", "'true'", "'{\"a\": 1, \"a\": 2}'",
        "'\"\\u0000\"'", "'\"\\ud83d\"'", "'{\"fail\": true}'",
        "repeat('[', 5000) || repeat(']', 5000)",
        "repeat('{\"a\": ', 5000) || '1' || repeat('}', 5000)",
        "repeat('[', 200000) || repeat(']', 200000)",
        "(SELECT jsonb_agg(g) FROM generate_series(1, 500000) AS g)",
        "to_jsonb(repeat('x', 4000000))",
        "(SELECT jsonb_object_agg('k' || g, g) FROM generate_series(1, 200000) AS g)",
        "jsonb_build_object('s', repeat('x', 7850))",
        "jsonb_build_object('s', repeat('x', 7950))",
        "jsonb_build_object('s', repeat('x', 8050))",
        f"jsonb_build_object({lit(chr(1))}, {lit(chr(0xffff))}, '', NULL)",
        "jsonb_build_object(repeat('k', 300), 1)",
    ]


def hostile_headers():
    """What a headers argument may be: any hostile jsonb (most of them not an
    object), and objects with odd members."""
    return hostile_jsonb() + [
        "'{\"h\": null}'", "'{\"h\": [1, {\"x\": 2}]}'", "'{\"\": \"\"}'",
        "(SELECT jsonb_object_agg('h' || g, 'v') FROM generate_series(1, 100000) AS g)",
        "jsonb_build_object('Location', repeat('x', 1000000))",
    ]


def hostile_bytea():
    """Empty, NUL, 0xff, lengths around 255, a megabyte."""
    return ["NULL", r"'\x'", r"'\x00'", r"'\xff'", "decode(repeat('ff', 255), 'hex')",
            "decode(repeat('00', 256), 'hex')", "decode(repeat('00', 1000000), 'hex')",
            f"convert_to(repeat({lit(EURO)}, 86), 'UTF8')"]


def hostile_targets():
    """Route targets: the four, their near misses, and hostile text."""
    return ["NULL", "''", "'notify'", "'logical'", "'function'", "'none'", "'NOTIFY'",
            "' notify'", "'notify '", "'kafka'", lit("notify\x01"), "repeat('n', 1000000)"]


def hostile_destinations():
    """Route destinations: channel names around 63 bytes, function names and
    signatures that resolve to the wrong thing, and hostile text."""
    names = [
        "repeat('c', 63)", "repeat('c', 64)", "'a b'", lit("a\tb"), "'idempotency_outbox'",
        "'fuzz.prefix'", "'fuzz_sink'", "'public.fuzz_sink'",
        "'public.fuzz_sink(idempotency.outbox)'", "'fuzz_sink(integer)'",
        "'fuzz_sink(idempotency.outbox, integer)'", "'fuzz_sink('", "'fuzz_sink()'",
        "'fuzz_proc'", "'public.fuzz_proc(idempotency.outbox)'", "'fuzz_wrong'",
        "'fuzz_overloaded'", "'fuzz_overloaded(idempotency.outbox)'", "'fuzz_setof'",
        "'fuzz_private'", "'pg_catalog.count'", "'pg_catalog.now'",
        "'pg_catalog.pg_terminate_backend'", "'idempotency.idem_outbox_requeue'",
        "'idempotency.outbox'", "'no_such_function'", "'no_such_schema.f'", "'a.b.c.d'",
        "'\"Fuzz Sink\"'", "'('", "'public.'", "'.fuzz_sink'", "'-'",
    ]
    return hostile_strings() + names


def hostile_ids():
    """Outbox ids: int8's ends, zero, and rows in each state."""
    return ["NULL", "-9223372036854775808", "-1", "0", "1", "9223372036854775807",
            "(SELECT max(id) FROM idempotency.outbox)",
            "(SELECT min(id) FROM idempotency.outbox WHERE state = 'dead')",
            "(SELECT min(id) FROM idempotency.outbox WHERE state = 'leased')",
            "(SELECT min(id) FROM idempotency.outbox WHERE state = 'pending')"]


def hostile_id_arrays():
    """bigint[]: empty, NULL elements, several dimensions (up to the maximum
    of 6), lower bounds other than 1, a million elements."""
    return ["NULL", "'{}'", "'{NULL}'", "'{NULL,NULL}'", "'{1,1,1}'", "'{{1,2},{3,4}}'",
            "'{{{{{{1}}}}}}'", "'[0:2]={1,2,3}'", "'[-5:-4]={1,2}'",
            "'{9223372036854775807,-9223372036854775808,0,-1}'",
            "array(SELECT generate_series(1, 1000000))",
            "array_fill(NULL::bigint, ARRAY[100000])", "array_fill(1::bigint, ARRAY[0])",
            "array_fill(7::bigint, ARRAY[2, 3, 2])",
            "(SELECT array_agg(id) FROM idempotency.outbox)",
            "(SELECT array_agg(id ORDER BY id DESC) FROM idempotency.outbox WHERE state = 'leased')"]


def hostile_name_arrays():
    """text[] of event ids: empty, NULL elements, several dimensions, lower
    bounds other than 1, elements at and past the 255-byte limit, the same
    id many times, odd characters, a hundred thousand elements (a bad one
    last)."""
    odd = ", ".join(lit(c) for c in ("\x01", "\x7f", "\u00a0", "\ufeff", "\uffff",
                                     "\U0010ffff", "e\u0301", "%s%n", "'", "\\"))
    return ["NULL", "'{}'", "'{NULL}'", "'{\"\"}'", "'{a,NULL}'", "'{a,\"\"}'", "'{a,a,a}'",
            "'{{a,b},{c,d}}'", "'{{{{{{a}}}}}}'", "'[0:2]={a,b,c}'", "'[-5:-4]={a,\"\"}'",
            "ARRAY[repeat('x', 255), repeat('y', 255)]", "ARRAY['a', repeat('x', 256)]",
            f"ARRAY['a', repeat({lit(EURO)}, 86)]", f"ARRAY[repeat({lit(E_ACUTE)}, 127) || 'x']",
            f"ARRAY[{odd}]", "array_fill('same'::text, ARRAY[10000])",
            "array_fill(NULL::text, ARRAY[1000])", "array_fill('x'::text, ARRAY[0])",
            "array_fill('x'::text, ARRAY[2, 3])",
            "array(SELECT 'fz-' || g FROM generate_series(1, 100000) AS g)",
            "array(SELECT 'fz-' || g FROM generate_series(100000, 1, -1) AS g) || NULL::text",
            "array(SELECT event_id FROM idempotency.processed_events)",
            "ARRAY['event-1', 'old-1', 'event-1', 'nonexistent']"]


def hostile_jsonb_arrays():
    """jsonb[] for idem_outbox_enqueue_batch's payloads and headers: empty,
    NULL elements, several dimensions, lower bounds other than 1, non-objects,
    a hundred thousand elements."""
    return ["NULL", "'{}'::jsonb[]", "ARRAY[NULL]::jsonb[]", "ARRAY['{}', NULL]::jsonb[]",
            "ARRAY[['{}'], ['{}']]::jsonb[]", "'[0:1]={\"{}\",\"[]\"}'::jsonb[]",
            "ARRAY['1', '\"x\"', '[]']::jsonb[]", "array_fill('{}'::jsonb, ARRAY[100000])",
            "array_fill('{}'::jsonb, ARRAY[2, 2])", "ARRAY[repeat('[', 5000) || repeat(']', 5000)]::jsonb[]"]


def hostile_text_arrays():
    """text[] for enqueue_batch's keys: empty and over-long elements, NULLs,
    lengths that differ from the payloads', several dimensions."""
    return ["NULL", "'{}'::text[]", "ARRAY[NULL]::text[]", "ARRAY['']", "ARRAY[repeat('k', 256)]",
            "ARRAY['a', 'b', 'a']", "ARRAY[['a'], ['b']]", "'[5:5]={a}'::text[]",
            "array_fill('k'::text, ARRAY[100000])", "ARRAY['a', NULL, repeat('x', 1000000)]"]


def hostile_attempt_arrays():
    """int[] for the fenced ack's attempts: the same shapes as the ids'."""
    return ["NULL", "'{}'::int[]", "'{NULL}'::int[]", "'{1,1,1}'::int[]", "'{{1,2},{3,4}}'::int[]",
            "'[0:2]={1,2,3}'::int[]", "'{-2147483648,2147483647,0}'::int[]",
            "array_fill(1, ARRAY[1000000])",
            "(SELECT array_agg(attempts) FROM idempotency.outbox)"]


def hostile_settings():
    """(setting, value) pairs for set_config(setting, value, true): the
    extension's settings at and past their limits (the outbox ones are the
    superuser's: as anyone else they are 42501)."""
    pairs = []
    for name in ("idempotency.key_ttl", "idempotency.lease", "idempotency.event_retention",
                 "idempotency.outbox_backoff_min", "idempotency.outbox_backoff_max",
                 "idempotency.outbox_retention"):
        for value in ("0", "-1", "1", "1us", "2147483647", "2147483648", "1000000d",
                      "infinity", "-1s", ""):
            pairs.append((name, lit(value)))
    for value in ("", "100-599", "599-100", "99", "600", "100,100", "0-1000", ",", "500-",
                  "-", "x", " 408 , 429 ", "2147483648", "-1", "100-200-300", "200,"):
        pairs.append(("idempotency.release_statuses", lit(value)))
    pairs.append(("idempotency.release_statuses",
                  "(SELECT string_agg(g::text, ',') FROM generate_series(100, 599) AS g)"))
    pairs.append(("idempotency.release_statuses", "repeat('1', 10000)"))
    for value in ("0", "1", "-1", "2147483647", "2147483648"):
        pairs.append(("idempotency.outbox_max_attempts", lit(value)))
    return pairs


# ---------------------------------------------------------------------------
# Valid values, so that the other arguments pass their checks.  Each takes
# the fuzzer (for its random generator) and the values chosen so far.
# ---------------------------------------------------------------------------

def valid_scope(fz, chosen):
    return fz.rng.choice(["'fz'", "'fz:POST /p'", "''", "'seed'"])


def valid_key(fz, chosen):
    # shared keys, keys of setup.sql (in progress, completed), a new key
    return fz.rng.choice(["'k1'", "'k2'", "'k3'", "'in-progress-1'", "'done-1'",
                          lit(f"k{fz.counter()}")])


def valid_text(fz, chosen):
    return fz.rng.choice(["NULL", "'v'", "'step 1'", "repeat('b', 300)"])


def valid_name(fz, chosen):
    return fz.rng.choice(["'c1'", "'c2'", "'event-1'", "'seed'", lit(f"e{fz.counter()}")])


def valid_names(fz, chosen):
    # processed events of setup.sql, expired ones, new ones, repeated
    return "ARRAY[%s]" % ", ".join(fz.rng.choice(["'event-1'", "'event-2'", "'old-1'", "'c1'",
                                                  lit(f"e{fz.counter()}")])
                                   for _ in range(fz.rng.randint(1, 4)))


def valid_topic(fz, chosen):
    return fz.rng.choice(["'fz-t1'", "'fz-t2'", "'seed-pending'", "'seed-leased'",
                          "'seed-dead'", "'seed-function'", "'seed-notify'"])


def valid_outbox_key(fz, chosen):
    return fz.rng.choice(["NULL", "'a'", "'b'"])


def valid_interval(fz, chosen):
    return fz.rng.choice(["NULL", "'1 min'", "'1 hour'", "'10 ms'"])


def valid_status(fz, chosen):
    return fz.rng.choice(["200", "201", "404", "500"])


def valid_attempt(fz, chosen):
    return fz.rng.choice(["NULL", "1"])


def valid_jsonb(fz, chosen):
    return fz.rng.choice(["'{\"n\": 1}'", "'[1, 2]'", "'{\"fail\": true}'"])


def valid_headers(fz, chosen):
    return fz.rng.choice(["NULL", "'{\"h\": \"v\"}'"])


def valid_bytea(fz, chosen):
    return r"'\x0102'"


def valid_target(fz, chosen):
    return fz.rng.choice(["'none'", "'notify'", "'logical'", "'function'"])


def valid_destination(fz, chosen):
    target = chosen.get("target", "")
    if target == "'notify'":
        return fz.rng.choice(["NULL", "'fuzz_channel'"])
    if target == "'logical'":
        return fz.rng.choice(["NULL", "'fuzz.prefix'"])
    if target == "'function'":
        return fz.rng.choice(["'public.fuzz_sink'", "'fuzz_sink(idempotency.outbox)'"])
    return "NULL"


def valid_count(fz, chosen):
    return fz.rng.choice(["1", "10", "100"])


def valid_id(fz, chosen):
    return str(fz.rng.randint(1, 150))


def valid_ids(fz, chosen):
    return "ARRAY[%s]" % ", ".join(str(fz.rng.randint(1, 150)) for _ in range(fz.rng.randint(1, 3)))


def valid_payloads(fz, chosen):
    return fz.rng.choice(["ARRAY['{\"n\": 1}', '{\"n\": 2}']::jsonb[]", "ARRAY['{}']::jsonb[]"])


def valid_batch_keys(fz, chosen):
    return fz.rng.choice(["NULL", "ARRAY['a', 'b']", "ARRAY['a']", "ARRAY[NULL, 'a']"])


def valid_batch_headers(fz, chosen):
    return fz.rng.choice(["NULL", "ARRAY['{\"h\": \"v\"}', NULL]::jsonb[]"])


def valid_attempts(fz, chosen):
    return "ARRAY[%s]" % ", ".join(str(fz.rng.randint(0, 3)) for _ in range(fz.rng.randint(1, 3)))


Kind = collections.namedtuple("Kind", "sql_type hostile valid")

KINDS = {
    "scope": Kind("text", hostile_strings, valid_scope),
    "key": Kind("text", hostile_strings, valid_key),
    "text": Kind("text", hostile_strings, valid_text),
    "name": Kind("text", hostile_strings, valid_name),
    "names": Kind("text[]", hostile_name_arrays, valid_names),
    "topic": Kind("text", hostile_strings, valid_topic),
    "outbox_key": Kind("text", hostile_strings, valid_outbox_key),
    "interval": Kind("interval", None, valid_interval),  # hostile: needs the server version
    "status": Kind("integer", hostile_status_codes, valid_status),
    "attempt": Kind("integer", hostile_attempts, valid_attempt),
    "jsonb": Kind("jsonb", hostile_jsonb, valid_jsonb),
    "headers": Kind("jsonb", hostile_headers, valid_headers),
    "bytea": Kind("bytea", hostile_bytea, valid_bytea),
    "target": Kind("text", hostile_targets, valid_target),
    "destination": Kind("text", hostile_destinations, valid_destination),
    "count": Kind("integer", hostile_counts, valid_count),
    "id": Kind("bigint", hostile_ids, valid_id),
    "ids": Kind("bigint[]", hostile_id_arrays, valid_ids),
    "payloads": Kind("jsonb[]", hostile_jsonb_arrays, valid_payloads),
    "batch_keys": Kind("text[]", hostile_text_arrays, valid_batch_keys),
    "batch_headers": Kind("jsonb[]", hostile_jsonb_arrays, valid_batch_headers),
    "attempts": Kind("integer[]", hostile_attempt_arrays, valid_attempts),
}

# ---------------------------------------------------------------------------
# The functions: name, arguments (parameter name, kind), flags.
#   claimed  the valid (scope, key) is first claimed (or otherwise prepared)
#            so that the call reaches the code behind "key not claimed"
#   from     also called in FROM forms: EXPLAIN, EXPLAIN ANALYZE, (f()).*,
#            LATERAL rescans, a scrollable cursor
#   view     not a function: SELECT * FROM idempotency.stats
# ---------------------------------------------------------------------------

Fn = collections.namedtuple("Fn", "name args flags")

FUNCTIONS = [
    Fn("idem_claim", [("scope", "scope"), ("key", "key"), ("fingerprint", "text"),
                      ("ttl", "interval"), ("lease", "interval")], {"from"}),
    Fn("idem_complete", [("scope", "scope"), ("key", "key"), ("status_code", "status"),
                         ("body", "text"), ("headers", "headers"), ("attempt", "attempt")],
       {"claimed"}),
    Fn("idem_release", [("scope", "scope"), ("key", "key"), ("attempt", "attempt")], {"claimed"}),
    Fn("idem_checkpoint", [("scope", "scope"), ("key", "key"), ("recovery_point", "text"),
                           ("attempt", "attempt")], {"claimed"}),
    Fn("idem_extend_lease", [("scope", "scope"), ("key", "key"), ("attempt", "attempt"),
                             ("lease", "interval")], {"claimed"}),
    Fn("idem_fingerprint", [("request", "jsonb")], set()),
    Fn("idem_fingerprint", [("request", "text")], set()),
    Fn("idem_fingerprint", [("request", "bytea")], set()),
    Fn("idem_mark_processed", [("consumer", "name"), ("event_id", "name"),
                               ("retention", "interval")], set()),
    Fn("idem_is_processed", [("consumer", "name"), ("event_id", "name")], set()),
    Fn("idem_mark_processed_batch", [("consumer", "name"), ("event_ids", "names"),
                                     ("retention", "interval")], {"from"}),
    Fn("idem_is_processed_batch", [("consumer", "name"), ("event_ids", "names")], {"from"}),
    Fn("idem_outbox_enqueue", [("topic", "topic"), ("payload", "jsonb"), ("key", "outbox_key"),
                               ("headers", "headers")], set()),
    Fn("idem_outbox_route", [("topic", "topic"), ("target", "target"),
                             ("destination", "destination")], set()),
    Fn("idem_outbox_enqueue_batch", [("topic", "topic"), ("payloads", "payloads"),
                                     ("keys", "batch_keys"), ("headers", "batch_headers")],
       {"from"}),
    Fn("idem_outbox_fetch", [("topic", "topic"), ("batch", "count"), ("lease", "interval"),
                             ("per_key", "count")], {"from"}),
    Fn("idem_outbox_ack", [("ids", "ids")], set()),
    Fn("idem_outbox_ack", [("ids", "ids"), ("attempts", "attempts")], set()),
    Fn("idem_outbox_nack", [("id", "id"), ("error", "text")], set()),
    Fn("idem_outbox_nack", [("id", "id"), ("error", "text"), ("attempt", "attempt")], set()),
    Fn("idem_outbox_requeue", [("id", "id")], set()),
    Fn("idem_outbox_discard", [("id", "id")], set()),
    Fn("idem_run_maintenance", [], set()),
    Fn("idem_stats_counters", [], set()),
    Fn("stats", [], {"view"}),
]

# how a "claimed" function's key is prepared before the call (random phase)
KEY_STATES = ["claimed", "claimed", "claimed", "lease-expired", "completed", "never-claimed"]

CONTEXTS = ["autocommit", "autocommit", "commit", "rollback", "read-only", "repeatable-read",
            "serializable", "savepoint", "setting"]

LOG_LINE = re.compile(r"^\S+ \S+ \S+ \[(?P<pid>\d+)\] (?:(?P<state>[0-9A-Z]{5}) )?"
                      r"(?P<level>[A-Z]+):  (?P<msg>.*)$")
CRASH_TEXT = re.compile(r"terminated by signal|was terminated|\bPANIC:|^TRAP:")


Stmt = collections.namedtuple("Stmt", "session sql is_call")  # session: "main" or "other"


class Session:
    """One connection, as one role, with what it ran lately."""

    def __init__(self, label, role):
        self.label, self.role = label, role
        self.conn = None
        self.pid = None
        self.history = collections.deque(maxlen=15)  # of this connection
        # race phase state
        self.task = None
        self.in_tx = self.aborted = False
        self.savepoints = 0
        self.claims = {}
        self.fetched = []

    async def connect(self, extra_settings=()):
        self.conn = await psycopg.AsyncConnection.connect(
            dbname=DB, autocommit=True, prepare_threshold=None,
            application_name="idem-fuzz " + self.label)
        setup = ["SET client_min_messages = warning", "SET statement_timeout = '30s'",
                 "SET plan_cache_mode = force_generic_plan", *extra_settings]
        if self.role:
            setup.append(f"SET SESSION AUTHORIZATION {self.role}")
        for sql in setup:
            await self.conn.execute(sql)
        self.in_tx = self.aborted = False
        self.savepoints = 0
        self.pid = self.conn.info.backend_pid
        self.history = collections.deque(maxlen=15)
        return self.pid

    async def close(self):
        if self.conn is not None:
            try:
                await self.conn.close()
            except psycopg.Error:
                pass


class Fuzzer:
    def __init__(self):
        self.rng = random.Random(SEED)
        self.started = time.monotonic()
        self.calls = 0
        self.phase_calls = collections.Counter()
        self.statements = 0
        self.outcomes = collections.Counter()  # SQLSTATE (or "ok") of each call
        self.findings = {}  # key -> dict
        self.pids = {}  # backend pid -> (session label, role, its statements)
        self.sessions = {}
        self._counter = 0
        self.log_offset = 0
        self.server_version = 0
        self.stopped_early = False
        self.replays = 0
        self.last_lost = -1e9
        self.lost_again = 0

    def counter(self):
        self._counter += 1
        return self._counter

    def out_of_time(self):
        if time.monotonic() - self.started > MAX_SECONDS:
            self.stopped_early = True
        return self.stopped_early

    # -- running statements ------------------------------------------------

    async def session(self, label, role, extra_settings=()):
        s = self.sessions.get(label)
        if s is None or s.conn is None or s.conn.closed:
            s = s or Session(label, role)
            await self.reconnect(s, extra_settings)
            self.sessions[label] = s
        return s

    async def reconnect(self, s, extra_settings=()):
        """Connect s again, waiting for a server that restarts after a crash."""
        await s.close()
        deadline = time.monotonic() + 60
        while True:
            try:
                pid = await s.connect(extra_settings)
                self.pids[pid] = (s.label, s.role, s.history)
                return pid
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)

    async def execute(self, s, sql, fetch=False):
        """Run one statement on s: ("ok", rows) or (SQLSTATE, message), or
        ("lost", message) when the connection went away."""
        self.statements += 1
        s.history.append(sql)
        try:
            cur = await s.conn.execute(sql)
            rows = await cur.fetchall() if fetch and cur.description else None
            result = "ok", rows
        except psycopg.Error as e:
            state = e.sqlstate
            if state is None or state.startswith("57P") or s.conn.broken:
                result = "lost", str(e).strip()
            else:
                result = state, (e.diag.message_primary or str(e)).strip()
        if VERBOSE:
            print(f"[{s.label}] {sql[:300]}\n    -> {result[0]}"
                  + ("" if result[0] == "ok" else f": {result[1][:200]}"), flush=True)
        return result

    def count(self, phase, state):
        self.calls += 1
        self.phase_calls[phase] += 1
        self.outcomes[state] += 1

    async def after_lost(self, s):
        """A backend died: every session goes (the server restarts when a
        backend crashes), and s comes back once the server accepts
        connections again, past the moment when the postmaster ends every
        backend; the others reconnect when next used."""
        self.last_lost = time.monotonic()
        for other in self.sessions.values():
            if other is not s:
                await other.close()
                other.conn = None
                other.task = None
        await s.close()
        s.conn = None
        await asyncio.sleep(1)
        await self.reconnect(s)

    def record(self, kind, message, role, statements, phase, where="", pid=None):
        if kind == "lost connection" and time.monotonic() - self.last_lost < 20:
            self.lost_again += 1  # a consequence of the crash already recorded
            return None
        key = (kind, where, message[:80])
        f = self.findings.get(key)
        if f:
            f["count"] += 1
            return None
        f = {"kind": kind, "message": message, "role": role, "statements": statements,
             "phase": phase, "where": where, "count": 1, "minimal": None, "pid": pid,
             "log": []}
        self.findings[key] = f
        print(f"!! finding ({phase}): {kind} in {where or 'a call'}: {message[:200]}", flush=True)
        return f

    # -- building calls ----------------------------------------------------

    def hostile(self, kind):
        if kind == "interval":
            return hostile_intervals(self.server_version)
        return KINDS[kind].hostile()

    def forms(self, fn):
        if "view" in fn.flags:
            return ["view"]
        forms = ["select", "from", "generic"]
        if "from" in fn.flags:
            forms += ["explain", "analyze", "rowexpr", "lateral", "cursor"]
        return forms

    def call_sql(self, fn, values, form):
        """The statements of one call of fn with the given SQL expressions."""
        if form == "view":
            return ["SELECT * FROM idempotency.stats"]
        name = "idempotency." + fn.name
        types = [KINDS[kind].sql_type for _, kind in fn.args]
        args = [f"({v})::{t}" for v, t in zip(values, types)]
        if form == "generic":
            # parameters of a generic plan; subqueries cannot be EXECUTE
            # parameters, so those stay in the prepared statement
            params, body, ptypes = [], [], []
            for v, t in zip(values, types):
                if "SELECT" in v:
                    body.append(f"({v})::{t}")
                else:
                    params.append(f"({v})::{t}")
                    ptypes.append(t)
                    body.append(f"${len(params)}")
            head = f"PREPARE fz({', '.join(ptypes)})" if ptypes else "PREPARE fz"
            tail = f"EXECUTE fz({', '.join(params)})" if params else "EXECUTE fz"
            return ["DEALLOCATE ALL", f"{head} AS SELECT * FROM {name}({', '.join(body)})", tail]
        call = f"{name}({', '.join(args)})"
        if form == "select":
            return [f"SELECT {call}"]
        if form == "from":
            return [f"SELECT * FROM {call}"]
        if form == "explain":
            return [f"EXPLAIN (VERBOSE, COSTS OFF) SELECT * FROM {call}"]
        if form == "analyze":
            return [f"EXPLAIN (ANALYZE, VERBOSE, COSTS OFF, TIMING OFF, SUMMARY OFF) SELECT * FROM {call}"]
        if form == "rowexpr":
            return [f"SELECT ({call}).*"]
        if form == "cursor":
            # a scrollable cursor: forwards, backwards, and from the start
            # again (the call is the first FETCH; plan() opens a transaction)
            return [f"DECLARE fzc SCROLL CURSOR FOR SELECT * FROM {call}", "FETCH ALL FROM fzc",
                    "FETCH BACKWARD ALL FROM fzc", "FETCH FIRST FROM fzc", "CLOSE fzc"]
        if form == "lateral":
            # the first argument refers to g (left('', g) is ''), so the
            # function is evaluated again for each of the three rows
            args[0] = f"{args[0]} || left('', g)"
            return [f"SELECT r.* FROM generate_series(1, 3) AS g, LATERAL {name}({', '.join(args)}) AS r"]
        raise ValueError(form)

    def choose_values(self, fn, hostile_at=None, hostile_value=None, p_hostile=0.0):
        """Values for fn's arguments: valid ones, with hostile_value at
        position hostile_at, or each hostile with probability p_hostile."""
        chosen, values = {}, []
        for i, (arg, kind) in enumerate(fn.args):
            if i == hostile_at:
                v = hostile_value
            elif hostile_at is None and self.rng.random() < p_hostile:
                v = self.rng.choice(self.hostile(kind))
            else:
                v = KINDS[kind].valid(self, chosen)
            chosen[arg] = v
            values.append(v)
        return values

    def plan(self, fn, values, form, context, key_state, hostile_at):
        """The statements of one call in its context: Stmt(session, sql, is_call)."""
        setup = []
        if "claimed" in fn.flags:
            # the fresh key replaces the valid scope and key, not a hostile one
            scope, key = valid_scope(self, {}), lit(f"fz-{self.counter()}")
            if hostile_at != 0:
                values[0] = scope
            if hostile_at != 1:
                values[1] = key
            claim = f"SELECT idempotency.idem_claim({scope}, {key}, NULL, NULL, %s)"
            setup = {"claimed": [claim % "'1 hour'"],
                     "lease-expired": [claim % "'1 ms'", "SELECT pg_sleep(0.005)"],
                     "completed": [claim % "'1 hour'",
                                   f"SELECT idempotency.idem_complete({scope}, {key}, 200, 'done')"],
                     "never-claimed": []}[key_state]
        call = self.call_sql(fn, values, form)
        is_call = "FETCH ALL FROM fzc" if form == "cursor" else call[-1]
        main = [Stmt("main", sql, sql == is_call) for sql in call]
        before = [Stmt("main", sql, False) for sql in setup]
        if form == "cursor" and context == "autocommit":
            context = "commit"  # a cursor without WITH HOLD needs a transaction
        if context == "autocommit":
            return before + main
        if context in ("commit", "rollback", "read-only"):
            begin = "BEGIN READ ONLY" if context == "read-only" else "BEGIN"
            end = "ROLLBACK" if context == "rollback" else "COMMIT"
            return before + [Stmt("main", begin, False)] + main + [Stmt("main", end, False)]
        if context in ("repeatable-read", "serializable"):
            # the key is prepared by another session after this one's snapshot
            level = context.replace("-", " ").upper()
            return ([Stmt("main", f"BEGIN ISOLATION LEVEL {level}", False),
                     Stmt("main", "SELECT 1", False)]
                    + [Stmt("other", sql, False) for sql in setup]
                    + main + [Stmt("main", "COMMIT", False)])
        if context == "savepoint":
            return (before + [Stmt("main", "BEGIN", False), Stmt("main", "SAVEPOINT s1", False)]
                    + main + [Stmt("main", "ROLLBACK TO SAVEPOINT s1", False)]
                    + main + [Stmt("main", "COMMIT", False)])
        if context == "setting":
            name, value = self.rng.choice(hostile_settings())
            return (before + [Stmt("main", "BEGIN", False),
                              Stmt("main", f"SELECT set_config('{name}', {value}, true)", False)]
                    + main + [Stmt("main", "COMMIT", False)])
        raise ValueError(context)

    # -- running one planned call ------------------------------------------

    async def run_plan(self, phase, fn, role, stmts, replay=False):
        """Run the statements; returns the finding state ("XX000", "lost") of
        the first statement that had one, or None."""
        label = ("replay-" if replay else "") + (role or "superuser")
        main = await self.session(label, role)
        other = await self.session("other", None)
        for i, st in enumerate(stmts):
            s = main if st.session == "main" else other
            state, detail = await self.execute(s, st.sql)
            if st.is_call and not replay:
                self.count(phase, state)
            if state in INTERNAL_ERRORS or state == "lost":
                if not replay:
                    f = self.record("SQLSTATE " + state if state != "lost" else "lost connection",
                                    detail, role or "superuser", stmts[:i + 1], phase,
                                    fn.name, s.pid)
                    if state == "lost":
                        await self.after_lost(s)
                    if f is not None:
                        await self.shrink(f, fn, role, stmts[:i + 1], state)
                elif state == "lost":
                    await self.after_lost(s)
                await self.cleanup(main, other)
                return state
            if state != "ok":
                break
        await self.cleanup(main, other)
        return None

    async def cleanup(self, *sessions):
        for s in sessions:
            if s.conn is not None and not s.conn.closed and \
                    s.conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                await self.execute(s, "ROLLBACK")

    async def shrink(self, finding, fn, role, stmts, state):
        """Replay smaller sets of the statements on fresh sessions; the
        smallest one that fails the same way is the minimal reproduction."""
        if self.replays >= 4:
            return
        self.replays += 1
        call = stmts[-1]
        candidates = [[call], [s for s in stmts if s.session == "main" and
                               not s.sql.startswith(("BEGIN", "SAVEPOINT", "SELECT set_config",
                                                     "ROLLBACK", "COMMIT"))]]
        for cand in candidates:
            if len(cand) >= len(stmts):
                continue
            if call.sql.startswith("EXECUTE") and not any(s.sql.startswith("PREPARE") for s in cand):
                continue
            # the server answers (after a crash: it has restarted) before
            # the candidate runs, so that a lost connection is its own
            for label, r in (("replay-" + (role or "superuser"), role), ("other", None)):
                probe = await self.session(label, r)
                if (await self.execute(probe, "SELECT 1"))[0] != "ok":
                    await self.after_lost(probe)
            got = await self.run_plan("replay", fn, role, cand, replay=True)
            if got == state:
                finding["minimal"] = cand
                return

    # -- phases --------------------------------------------------------------

    def sweep_calls(self):
        """(fn, values, form, role, hostile_at) for the sweep, in order."""
        calls, i = [], 0
        roles = [None, APP_ROLE]
        for fn in FUNCTIONS:
            forms = self.forms(fn)
            calls.append((fn, self.choose_values(fn), forms[0], None, None))
            if fn.args:
                calls.append((fn, ["NULL"] * len(fn.args), forms[i % len(forms)], APP_ROLE, None))
            for pos, (_, kind) in enumerate(fn.args):
                for h in self.hostile(kind):
                    i += 1
                    calls.append((fn, self.choose_values(fn, pos, h), forms[i % len(forms)],
                                  roles[i % 2], pos))
        return calls

    async def phase_sweep(self, calls, budget):
        if budget < len(calls):
            keep = sorted(self.rng.sample(range(len(calls)), budget))
            calls = [calls[i] for i in keep]
        print(f"-- sweep: {len(calls)} calls", flush=True)
        for fn, values, form, role, pos in calls:
            if self.out_of_time():
                return
            await self.run_plan("sweep", fn, role,
                                self.plan(fn, values, form, "autocommit", "claimed", pos))

    async def phase_random(self, budget):
        print(f"-- random: {budget} calls", flush=True)
        weights = [8 if "claimed" in fn.flags or fn.name == "idem_claim" else 3 for fn in FUNCTIONS]
        n = 0
        while n < budget and not self.out_of_time():
            fn = self.rng.choices(FUNCTIONS, weights)[0]
            values = self.choose_values(fn, p_hostile=0.35)
            form = self.rng.choice(self.forms(fn))
            role = self.rng.choices([None, APP_ROLE, NO_ROLE], [45, 45, 10])[0]
            context = self.rng.choice(CONTEXTS)
            key_state = self.rng.choice(KEY_STATES)
            stmts = self.plan(fn, values, form, context, key_state, None)
            await self.run_plan("random", fn, role, stmts)
            n += sum(st.is_call for st in stmts)

    # -- races -------------------------------------------------------------

    RACE_KEYS = ["r1", "r2", "r3", "r4"]
    BEGINS = ["BEGIN", "BEGIN ISOLATION LEVEL REPEATABLE READ", "BEGIN ISOLATION LEVEL SERIALIZABLE",
              "BEGIN READ ONLY", "BEGIN ISOLATION LEVEL SERIALIZABLE, READ ONLY, DEFERRABLE"]

    def race_op(self, s):
        """The next statement of session s: (sql, is_call, what)."""
        r = self.rng.random()
        if self.takeover_key and s is not self.takeover_from and not s.aborted:
            # another session's claim ran out a moment ago: take it over
            k, self.takeover_key = self.takeover_key, None
            return (f"SELECT outcome, attempt FROM idempotency.idem_claim('race', '{k}')",
                    True, ("claim", k))
        if s.aborted:
            if s.savepoints and r < 0.6:
                return f"ROLLBACK TO SAVEPOINT s{s.savepoints}", False, "rollback-to"
            return "ROLLBACK", False, "end"
        if not s.in_tx and r < 0.3:
            return self.rng.choice(self.BEGINS), False, "begin"
        if s.in_tx and r < 0.12:
            return self.rng.choice(["COMMIT", "COMMIT", "ROLLBACK"]), False, "end"
        if s.in_tx and r < 0.18:
            return f"SAVEPOINT s{s.savepoints + 1}", False, "savepoint"
        if s.in_tx and s.savepoints and r < 0.22:
            return self.rng.choice([f"ROLLBACK TO SAVEPOINT s{s.savepoints}",
                                    f"RELEASE SAVEPOINT s{s.savepoints}"]), False, "release"
        # each round has keys of its own (a completed key stays completed for
        # key_ttl)
        k = f"{self.rng.choice(self.RACE_KEYS)}-{self.race_rounds}"
        attempt = self.rng.choice([str(s.claims.get(k) or "NULL"), "NULL",
                                   str(self.rng.randint(1, 4))])
        if self.rng.random() < 0.1:
            attempt = self.rng.choice(hostile_attempts())
        op = self.rng.choices(
            ["claim", "complete", "release", "checkpoint", "extend", "takeover", "mark",
             "is_processed", "mark_batch", "is_processed_batch",
             "enqueue", "fetch", "ack", "nack", "dead", "maintenance", "stats"],
            [25, 14, 8, 8, 4, 8, 8, 4, 6, 2, 8, 6, 4, 4, 2, 2, 1])[0]
        if op == "takeover" and s.in_tx:
            op = "claim"  # a takeover needs a committed claim to take over
        ev = lit("e" + k[1:])  # events named after the key
        if op == "claim":
            fp = self.rng.choice(["NULL", "'f1'", "'f2'"])
            # a short ttl lets completed keys expire and be claimed anew
            ttl = self.rng.choice(["NULL", "'30 ms'", "'200 ms'"])
            lease = self.rng.choice(["NULL", "'10 ms'", "'50 ms'", "'1 hour'"])
            return (f"SELECT outcome, attempt FROM idempotency.idem_claim('race', '{k}', {fp}, {ttl}, {lease})",
                    True, ("claim", k))
        if op == "takeover":  # a claim that commits at once, with a short lease
            return (f"SELECT outcome, attempt FROM idempotency.idem_claim('race', '{k}', NULL, NULL, '5 ms')",
                    True, ("takeover", k))
        if op == "complete":
            status = self.rng.choice(["200", "201", "409", "429", "500", "100"])
            return (f"SELECT idempotency.idem_complete('race', '{k}', {status}, 'body', NULL, {attempt})",
                    True, "complete")
        if op == "release":
            return f"SELECT idempotency.idem_release('race', '{k}', {attempt})", True, "release"
        if op == "checkpoint":
            rp = self.rng.choice(["NULL", "'step 2'", "repeat('r', 5000)"])
            return f"SELECT idempotency.idem_checkpoint('race', '{k}', {rp}, {attempt})", True, "checkpoint"
        if op == "extend":
            lease = self.rng.choice(["NULL", "'10 ms'", "'1 hour'"])
            return f"SELECT idempotency.idem_extend_lease('race', '{k}', {attempt}, {lease})", True, "extend"
        if op == "mark":
            retention = self.rng.choice(["NULL", "'10 ms'", "'1 day'"])
            return f"SELECT idempotency.idem_mark_processed('race', {ev}, {retention})", True, "mark"
        if op == "is_processed":
            return f"SELECT idempotency.idem_is_processed('race', {ev})", True, "is_processed"
        if op in ("mark_batch", "is_processed_batch"):
            # some of the round's events, in any order: batches that overlap
            # in different orders, and with the single marks
            evs = ", ".join(lit(f"e{n[1:]}-{self.race_rounds}") for n in
                            self.rng.sample(self.RACE_KEYS, self.rng.randint(1, len(self.RACE_KEYS))))
            if op == "is_processed_batch":
                return (f"SELECT * FROM idempotency.idem_is_processed_batch('race', ARRAY[{evs}])",
                        True, op)
            retention = self.rng.choice(["NULL", "'10 ms'", "'1 day'"])
            return (f"SELECT * FROM idempotency.idem_mark_processed_batch('race', ARRAY[{evs}], {retention})",
                    True, op)
        if op == "enqueue":
            okey = self.rng.choice(["NULL", "'a'", "'b'"])
            if self.rng.random() < 0.3:
                return (f"SELECT idempotency.idem_outbox_enqueue_batch('race-t', ARRAY['{{\"n\": {self.counter()}}}',"
                        f" '{{\"n\": {self.counter()}}}']::jsonb[], ARRAY[{okey}, 'b'])", True, "enqueue")
            return (f"SELECT idempotency.idem_outbox_enqueue('race-t', '{{\"n\": {self.counter()}}}', {okey})",
                    True, "enqueue")
        if op == "fetch":
            batch = self.rng.randint(1, 5)
            lease = self.rng.choice(["'20 ms'", "'1 s'"])
            per_key = self.rng.choice([1, 1, 2, 4])
            return (f"SELECT id FROM idempotency.idem_outbox_fetch('race-t', {batch}, {lease}, {per_key})",
                    True, "fetch")
        if op == "ack":
            ids = ", ".join(str(i) for i in (s.fetched[-3:] or [self.rng.randint(1, 300)]))
            if self.rng.random() < 0.5:  # fenced, with a guess at each row's attempt
                attempts = ", ".join(str(self.rng.randint(1, 3)) for _ in ids.split(", "))
                return (f"SELECT idempotency.idem_outbox_ack(ARRAY[{ids}]::bigint[], ARRAY[{attempts}])",
                        True, "ack")
            return f"SELECT idempotency.idem_outbox_ack(ARRAY[{ids}]::bigint[])", True, "ack"
        if op == "nack":
            i = s.fetched[-1] if s.fetched else self.rng.randint(1, 300)
            attempt = self.rng.choice(["", ", 1", ", 2"])
            return f"SELECT idempotency.idem_outbox_nack({i}, 'race failure'{attempt})", True, "nack"
        if op == "dead":
            fn = self.rng.choice(["idem_outbox_requeue", "idem_outbox_discard"])
            return (f"SELECT idempotency.{fn}((SELECT min(id) FROM idempotency.outbox "
                    f"WHERE state = 'dead' AND topic = 'race-t'))", True, "dead")
        if op == "maintenance":
            return "SELECT * FROM idempotency.idem_run_maintenance()", True, "maintenance"
        return "SELECT * FROM idempotency.stats", True, "stats"

    async def race_step(self, s, sql, is_call, what):
        state, detail = await self.execute(s, sql, fetch=True)
        self.race_log.append(f"/* {s.label} */ {sql}")
        if is_call:
            self.count("races", state)
        if state in INTERNAL_ERRORS or state == "lost":
            name = re.search(r"idempotency\.(\w+)", sql)
            self.record("SQLSTATE " + state if state != "lost" else "lost connection", detail,
                        s.role or "superuser", list(self.race_log), "races",
                        name.group(1) if name else "", s.pid)
            if state == "lost":
                await self.after_lost(s)
                self.race_aborted = True
            return
        status = s.conn.info.transaction_status
        s.in_tx = status != psycopg.pq.TransactionStatus.IDLE
        s.aborted = status == psycopg.pq.TransactionStatus.INERROR
        if not s.in_tx:
            s.savepoints = 0
        elif what == "savepoint" and state == "ok":
            s.savepoints += 1
        elif what == "release" and state == "ok":
            s.savepoints -= 1
        if state != "ok":
            return
        if isinstance(what, tuple):
            rows = detail or []
            if rows and rows[0][0] == "claimed":
                s.claims[what[1]] = rows[0][1]
            if what[0] == "takeover":
                await asyncio.sleep(0.015)  # past the lease: another session takes it over
                self.takeover_key, self.takeover_from = what[1], s
        elif what == "fetch":
            s.fetched = [r[0] for r in detail or []][-10:]

    async def phase_races(self, budget):
        print(f"-- races: {budget} calls", flush=True)
        self.takeover_key = self.takeover_from = None
        self.race_log = collections.deque(maxlen=20)
        self.race_rounds = 0
        start = self.phase_calls["races"]
        while self.phase_calls["races"] - start < budget and not self.out_of_time():
            self.race_rounds += 1
            n = self.rng.randint(2, 4)
            sessions = []
            for i in range(n):
                role = self.rng.choice([None, APP_ROLE])
                extra = ["SET statement_timeout = '10s'"]
                if role is None:
                    extra.append("SET idempotency.outbox_max_attempts = 2")
                sessions.append(await self.session(f"race{i}-{role or 'superuser'}", role, extra))
            await self.race_round(sessions, min(60, budget - (self.phase_calls["races"] - start)))
        print(f"   ({self.race_rounds} rounds)", flush=True)

    async def race_round(self, sessions, steps):
        self.race_aborted = False
        calls_at_start = self.phase_calls["races"]
        while self.phase_calls["races"] - calls_at_start < steps and not self.race_aborted:
            for s in sessions:
                if s.task is not None and s.task.done():
                    s.task.result()
                    s.task = None
            idle = [s for s in sessions if s.task is None and s.conn is not None]
            if not idle:
                busy = {s.task for s in sessions if s.task is not None}
                if not busy:
                    break
                await asyncio.wait(busy, timeout=15, return_when=asyncio.FIRST_COMPLETED)
                continue
            if self.takeover_key:
                idle = [t for t in idle if t is not self.takeover_from] or idle
            s = self.rng.choice(idle)
            sql, is_call, what = self.race_op(s)
            s.task = asyncio.create_task(self.race_step(s, sql, is_call, what))
            # let it finish, unless it waits for another session
            await asyncio.wait({s.task}, timeout=0.05)
        # end of the round: finish every transaction, waiters last
        while True:
            for s in sessions:
                if s.task is not None and s.task.done():
                    s.task.result()
                    s.task = None
            pending = {s.task for s in sessions if s.task is not None}
            for s in sessions:
                if s.task is None and s.conn is not None and not s.conn.closed and s.in_tx:
                    s.task = asyncio.create_task(self.race_step(s, "ROLLBACK", False, "end"))
                    pending.add(s.task)
            if not pending:
                break
            await asyncio.wait(pending, timeout=15, return_when=asyncio.FIRST_COMPLETED)
        for s in sessions:
            if s.conn is None or s.conn.closed:
                self.sessions.pop(s.label, None)

    # -- setup, log, summary -------------------------------------------------

    async def setup(self):
        admin = await psycopg.AsyncConnection.connect(dbname="postgres", autocommit=True)
        self.server_version = admin.info.server_version
        await admin.execute(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{DB}"')
        await admin.close()
        conn = await psycopg.AsyncConnection.connect(dbname=DB, autocommit=True)
        await conn.execute("SET client_min_messages = warning")
        with open(SETUP_SQL) as f:
            await conn.execute(f.read())
        await conn.close()
        if SERVER_LOG and os.path.exists(SERVER_LOG):
            self.log_offset = os.path.getsize(SERVER_LOG)

    def scan_log(self):
        if not SERVER_LOG:
            print("(no FUZZ_SERVER_LOG: the server log was not read)")
            return
        with open(SERVER_LOG, "rb") as f:
            f.seek(self.log_offset)
            lines = f.read().decode("utf-8", "replace").splitlines()
        for line in lines:
            m = LOG_LINE.match(line)
            if m:
                if m["level"] in ("STATEMENT", "DETAIL", "HINT", "CONTEXT", "QUERY", "LOCATION"):
                    continue
                internal = m["state"] in INTERNAL_ERRORS and int(m["pid"]) not in self.pids
                if not (internal or CRASH_TEXT.search(m["level"] + ": " + m["msg"])):
                    continue
            elif line[:1].isspace() or not CRASH_TEXT.search(line):
                continue
            # a backend's end names its PID: the finding of that session's
            # lost connection gets the line; otherwise the line is a finding,
            # with what that session ran last
            pid = re.search(r"\(PID (\d+)\)", line)
            pid = int(pid.group(1)) if pid else int(m["pid"]) if m else None
            known = [f for f in self.findings.values() if f["pid"] is not None and f["pid"] == pid]
            if known:
                known[0]["log"].append(line.strip())
                continue
            label, role, history = self.pids.get(pid, ("", "", []))
            stmts = [Stmt("main", sql, True) for sql in history]
            self.record("server log", line.strip(), role or ("superuser" if label else ""),
                        stmts, "log", label or "the server")

    def summary(self, elapsed):
        print()
        print("== idempotency argument fuzzer: summary")
        print(f"seed: {SEED}   (FUZZ_SEED={SEED} FUZZ_CALLS={CALLS} repeats this run)")
        print(f"server: {self.server_version // 10000}.{self.server_version % 10000}, database {DB}")
        phases = ", ".join(f"{p} {self.phase_calls[p]}" for p in ("sweep", "random", "races"))
        print(f"calls: {self.calls} ({phases}); {self.statements} statements in {elapsed:.1f} s"
              + ("  [stopped early: FUZZ_MAX_SECONDS]" if self.stopped_early else ""))
        print("outcomes per SQLSTATE class:")
        classes = collections.defaultdict(collections.Counter)
        for state, n in self.outcomes.items():
            classes[state if state in ("ok", "lost") else state[:2]][state] += n
        for cls in sorted(classes, key=lambda c: (c != "ok", c)):
            codes = classes[cls]
            detail = "" if cls in ("ok", "lost") else " (" + ", ".join(
                f"{code} {n}" for code, n in codes.most_common()) + ")"
            print(f"  {cls:>4}  {sum(codes.values()):6}{detail}")
        if not self.findings:
            print("findings: none")
            return
        print(f"findings: {len(self.findings)}")
        for n, f in enumerate(self.findings.values(), 1):
            print(f"-- finding {n}: {f['kind']} in {f['where']} ({f['phase']} phase, "
                  f"seen {f['count']} time(s), seed {SEED})")
            print(f"   {f['message'][:500]}")
            for line in f["log"]:
                print(f"   server log: {line[:500]}")
            stmts = f["minimal"] or f["statements"]
            if stmts:
                role = f["role"]
                print("   reproduction" + (" (shrunk)" if f["minimal"] else "") + ", in database "
                      f"{DB} made by test/fuzz/setup.sql, as "
                      + (f"SET SESSION AUTHORIZATION {role}" if role not in ("", "superuser")
                         else "the superuser") + ", with SET plan_cache_mode = force_generic_plan:")
                for st in stmts:
                    sql = st.sql if isinstance(st, Stmt) else st
                    other = isinstance(st, Stmt) and st.session == "other"
                    print("     " + ("/* another session, as the superuser */ " if other else "")
                          + sql + ";")


async def main():
    print(f"idempotency argument fuzzer: seed {SEED} (FUZZ_SEED), {CALLS} calls (FUZZ_CALLS), "
          f"database {DB}", flush=True)
    fz = Fuzzer()
    await fz.setup()
    sweep_calls = fz.sweep_calls()
    sweep = min(len(sweep_calls), int(CALLS * 0.6))
    random_calls = (CALLS - sweep) // 2
    try:
        await fz.phase_sweep(sweep_calls, sweep)
        await fz.phase_random(random_calls)
        await fz.phase_races(CALLS - fz.calls)
    finally:
        for s in list(fz.sessions.values()):
            await s.close()
    # the server must still be there
    try:
        conn = await psycopg.AsyncConnection.connect(dbname=DB, autocommit=True)
        await conn.execute("SELECT 1")
        await conn.close()
    except psycopg.Error as e:
        fz.record("server gone", str(e), "", [], "end", "server")
    await asyncio.sleep(1.5)  # let the worker log what it did with the last rows
    fz.scan_log()
    fz.summary(time.monotonic() - fz.started)
    return 1 if fz.findings else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
