#!/usr/bin/env python3
"""Differential fuzz of the two editions (part of make check-sql-edition).

The same random call sequences run on the C edition and on the SQL edition,
statement by statement, and must give the same results and the same errors
(SQLSTATE and message).  A sequence mixes every key, deduplication and
fingerprint function, the outbox's (enqueue, routes, the pull API) and
idem_run_maintenance, with valid arguments on a few shared keys, events and
topics and, now and then, one of fuzz_args.py's hostile
values in any argument position; two sessions per edition, each going in and
out of transactions (READ WRITE and READ ONLY), savepoints rolled back to
or released, and valid values of the settings.

The sessions are driven one statement at a time, the same statement on
both editions before the next: a statement that waits for the other
session's transaction waits until lock_timeout (which both editions obey)
and fails with 55P03 on both, so the outcome does not depend on timing.
Values that depend on the clock (timestamps in results) are compared as
present or NULL.

Exit status 1 at the first difference, printed with the seed and the
statements of both sessions that led to it; FUZZ_SEED repeats a run.

Environment: DIFF_C_DSN and DIFF_SQL_DSN (libpq connection strings of the
two databases, each with its edition installed, as a superuser),
FUZZ_SEED, DIFF_SECONDS (default 30), DIFF_STEPS (default 100000: the
seconds usually end the run first), FUZZ_VERBOSE=1.
"""

import datetime
import os
import random
import re
import sys
import time

import psycopg
from psycopg.types.string import TextLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fuzz_args as fa  # noqa: E402  (its hostile values)

SEED = int(os.environ.get("FUZZ_SEED") or random.SystemRandom().randrange(1, 2**31))
SECONDS = float(os.environ.get("DIFF_SECONDS") or 30)
STEPS = int(os.environ.get("DIFF_STEPS") or 100000)
VERBOSE = bool(os.environ.get("FUZZ_VERBOSE"))

# ---------------------------------------------------------------------------
# What differs between the editions by design, and so is not generated: the
# one place where the differential fuzz leaves something out.  Each is a
# documented difference (sql-edition/differences.patch's header and hunks,
# doc/internals.md's "The SQL edition") or a matter of timing, not edition.
# ---------------------------------------------------------------------------
EXCLUDED = {
    # REPEATABLE READ and SERIALIZABLE: a row committed after the snapshot is
    # not seen by SQL, so the SQL edition raises 40001 where C answers replay
    # or in_progress (claim_isolation_levels).  Transactions here are READ
    # COMMITTED, read-write or read-only.
    "isolation_levels": ["REPEATABLE READ", "SERIALIZABLE"],
    # Deadlocks: which of two sessions the server picks as the victim, and
    # whether a lock order makes one at all, differ (advisory lock then row
    # against row alone).  Driving the sessions one statement at a time,
    # with lock_timeout, never makes one.
    "deadlocks": True,
    # An empty idempotency.release_statuses: '' is the SQL edition's unset
    # (the default list), C's empty list; both read ' ' as the empty list.
    "setting_values": {"idempotency.release_statuses": [""]},
    # A bad value of a setting: C refuses the SET, the SQL edition checks it
    # where it is used (with C's message).  Only valid values are set, and
    # the value set is not compared: C shows it in its unit ('7200' as
    # '2h'), the SQL edition as given.
    "bad_setting_values": True,
    "setting_shown": True,
    # Counters live in the C edition's shared memory (no row without it).
    "functions": ["idem_stats_counters", "stats"],
    # Durations so short that a lease or ttl runs out between two
    # statements, or not, by the clock: timing, not edition.
    "intervals": ["'1 us'", "'1 ms'", "'10 ms'"],
    # A positive wait of idem_claim: how long it waits is timing (the
    # claim_wait specs test it).  Only NULL, zero and negative waits.
    "positive_waits": True,
    # Routes that publish to notify or logical: the SQL edition publishes a
    # row at its enqueue, the C edition's worker after the commit, when it
    # wakes: which rows are still pending at a given statement is timing.
    # Valid routes are set to none; the function target is fuzzed for its
    # errors only (no function in these databases takes an outbox row; a
    # route function runs as the role that set the route in C, as the
    # edition's owner only in SQL: sql_edition_outbox tests that).
    "route_targets": ["notify", "logical"],
    # A backoff that ends during the run: each edition draws its own jitter,
    # so a row may be ready again on one and not yet on the other.  The
    # sessions set the backoff to hours, and leave it (SESSION_SETTINGS);
    # leases are an hour or more.  publish_batch_size is the server's
    # (PGC_SIGHUP) in C.
    "outbox_settings": ["idempotency.outbox_backoff_min", "idempotency.outbox_backoff_max",
                        "idempotency.publish_batch_size"],
}

SETTINGS = {
    "idempotency.key_ttl": ["'2h'", "'1d'", "'3600'"],
    "idempotency.lease": ["'30min'", "'2h'", "'90000'"],
    "idempotency.event_retention": ["'3d'", "'7200'"],
    "idempotency.release_statuses": ["'500-599'", "'408,429'", "' '", "'200-299, 404'", "''"],
    "idempotency.outbox_max_attempts": ["'1'", "'2'", "'10'"],
    "idempotency.outbox_retention": ["'0'", "'1h'"],
    "idempotency.notify_truncated_retention": ["'0'", "'1h'"],
}
SESSION_SETTINGS = ("SET idempotency.outbox_backoff_min = '1h'",
                    "SET idempotency.outbox_backoff_max = '2h'")
for _name, _bad in EXCLUDED["setting_values"].items():
    SETTINGS[_name] = [v for v in SETTINGS[_name] if v.strip("'") not in _bad]

KEYS = ["'k1'", "'k2'", "'k3'"]
TOPICS = ["'t1'", "'t1'", "'t2'"]
LEASED = "idempotency.outbox WHERE state = 'leased'"


def ordered_arrays(values):
    """The rows' order in the heap differs between the editions: ordered."""
    return [re.sub(r"array_agg\((\w+)\) FROM idempotency\.outbox\)",
                   r"array_agg(\1 ORDER BY id) FROM idempotency.outbox)", v) for v in values]
EVENTS = ["'e1'", "'e2'", "'e3'"]


class Values:
    """The arguments: valid ones on the shared keys and events, or a hostile
    value of fuzz_args.py."""

    def __init__(self, rng):
        self.rng = rng
        self.n = 0
        self.hostile = {
            "text": fa.hostile_strings(),
            "interval": [v for v in fa.hostile_intervals(150000) if v not in EXCLUDED["intervals"]],
            "status": fa.hostile_status_codes(),
            "attempt": fa.hostile_attempts(),
            "jsonb": fa.hostile_jsonb(),
            "headers": fa.hostile_headers(),
            "bytea": fa.hostile_bytea(),
            # the rows' order in the heap differs between the editions: ordered
            "names": [v.replace("FROM idempotency.processed_events)",
                                "FROM idempotency.processed_events ORDER BY consumer, event_id)")
                      for v in fa.hostile_name_arrays()],
        }
        self.hostile.update({
            "topic": fa.hostile_strings() + ["'*'"],
            "target": [v for v in fa.hostile_targets() if v.strip("'") not in EXCLUDED["route_targets"]],
            "destination": fa.hostile_destinations(),
            "id": fa.hostile_ids(),
            "ids": ordered_arrays(fa.hostile_id_arrays()),
            "count": fa.hostile_counts(),
            "jsonbs": fa.hostile_jsonb_arrays(),
            "texts": fa.hostile_text_arrays(),
            "attempts": ordered_arrays(fa.hostile_attempt_arrays()),
        })
        self.hostile["wait"] = [v for v in self.hostile["interval"]
                                if v in ("NULL", "'0'") or re.fullmatch(r"'-\d+ [a-z]+'", v)]

    def fresh(self, prefix):
        self.n += 1
        return f"'{prefix}{self.n}'"

    def valid(self, kind):
        r = self.rng
        if kind == "scope":
            return r.choice(["'fz'", "'fz'", "'fz:POST /x'"])
        if kind == "key":
            return r.choice(KEYS + KEYS + [self.fresh("n")])
        if kind == "consumer":
            return r.choice(["'c1'", "'c1'", "'c2'"])
        if kind == "event":
            return r.choice(EVENTS + EVENTS + [self.fresh("ev")])
        if kind == "names":
            return "ARRAY[%s]::text[]" % ", ".join(
                r.choice(EVENTS + [self.fresh("ev")]) for _ in range(r.randint(1, 4)))
        if kind == "fingerprint":
            return r.choice(["NULL", "NULL", "'fp-a'", "'fp-b'"])
        if kind == "text":
            return r.choice(["NULL", "'step 1'", "'body'"])
        if kind == "ttl":
            return r.choice(["NULL", "NULL", "'1 hour'", "'2 days'"])
        if kind == "lease":
            return r.choice(["NULL", "NULL", "'1 min'", "'1 hour'"])
        if kind == "wait":
            return r.choice(["NULL", "NULL", "'0'"])
        if kind == "status":
            return r.choice(["200", "201", "404", "500", "503", "429"])
        if kind == "attempt":
            return r.choice(["NULL", "NULL", "1", "2"])
        if kind == "headers":
            return r.choice(["NULL", "'{\"h\": \"v\"}'"])
        if kind in ("jsonb", "payload"):
            return r.choice(["'{\"b\": 1, \"a\": [1, 2]}'", "'[]'"])
        if kind == "bytea":
            return r.choice([r"'\x0102'", r"'\x'"])
        if kind == "topic":
            return r.choice(TOPICS)
        if kind == "okey":
            return r.choice(["NULL"] + KEYS)
        if kind == "target":
            return "'none'"
        if kind == "destination":
            return "NULL"
        if kind == "id":
            return r.choice([f"(SELECT min(id) FROM {LEASED})", f"(SELECT max(id) FROM {LEASED})",
                             "(SELECT min(id) FROM idempotency.outbox WHERE state = 'dead')", "0"])
        if kind == "ids":
            return r.choice([f"(SELECT array_agg(id ORDER BY id) FROM {LEASED})",
                             f"(SELECT array_agg(id ORDER BY id DESC) FROM {LEASED})",
                             f"(SELECT array_agg(id ORDER BY id) FROM (SELECT id FROM {LEASED} ORDER BY id LIMIT 1) AS l)",
                             "'{}'"])
        if kind == "attempts":
            return r.choice([f"(SELECT array_agg(attempts ORDER BY id) FROM {LEASED})",
                             f"(SELECT array_agg(attempts - 1 ORDER BY id) FROM {LEASED})"])
        if kind == "flease":
            return r.choice(["'1 hour'", "'2 hours'"])
        if kind == "count":
            return r.choice(["1", "2", "10", "100"])
        if kind == "jsonbs":
            return r.choice(["ARRAY['{\"n\": 1}', '{\"n\": 2}']::jsonb[]", "ARRAY['{}']::jsonb[]"])
        if kind == "texts":
            return r.choice(["NULL", "ARRAY['k1', 'k2']", "ARRAY['k3', NULL]", "ARRAY['k1']"])
        raise ValueError(kind)

    def pick(self, kind, sql_type, p_hostile):
        hostile_kind = {"scope": "text", "key": "text", "consumer": "text", "event": "text",
                        "fingerprint": "text", "ttl": "interval", "lease": "interval",
                        "okey": "text", "payload": "jsonb", "flease": "interval"}.get(kind, kind)
        if hostile_kind in self.hostile and self.rng.random() < p_hostile:
            value = self.rng.choice(self.hostile[hostile_kind])
        else:
            value = self.valid(kind)
        return f"({value})::{sql_type}"


# name, [(kind, sql type)]
FUNCTIONS = [
    ("idem_claim", [("scope", "text"), ("key", "text"), ("fingerprint", "text"),
                    ("ttl", "interval"), ("lease", "interval"), ("wait", "interval")]),
    ("idem_claim", [("scope", "text"), ("key", "text"), ("fingerprint", "text")]),
    ("idem_complete", [("scope", "text"), ("key", "text"), ("status", "integer"),
                       ("text", "text"), ("headers", "jsonb"), ("attempt", "integer")]),
    ("idem_release", [("scope", "text"), ("key", "text"), ("attempt", "integer")]),
    ("idem_checkpoint", [("scope", "text"), ("key", "text"), ("text", "text"),
                         ("attempt", "integer")]),
    ("idem_extend_lease", [("scope", "text"), ("key", "text"), ("attempt", "integer"),
                           ("lease", "interval")]),
    ("idem_fingerprint", [("jsonb", "jsonb")]),
    ("idem_fingerprint", [("text", "text")]),
    ("idem_fingerprint", [("bytea", "bytea")]),
    ("idem_mark_processed", [("consumer", "text"), ("event", "text"), ("ttl", "interval")]),
    ("idem_is_processed", [("consumer", "text"), ("event", "text")]),
    ("idem_mark_processed_batch", [("consumer", "text"), ("names", "text[]"), ("ttl", "interval")]),
    ("idem_is_processed_batch", [("consumer", "text"), ("names", "text[]")]),
    ("idem_run_maintenance", []),
    ("idem_outbox_enqueue", [("topic", "text"), ("payload", "jsonb"), ("okey", "text"),
                             ("headers", "jsonb")]),
    ("idem_outbox_enqueue_batch", [("topic", "text"), ("jsonbs", "jsonb[]"), ("texts", "text[]")]),
    ("idem_outbox_route", [("topic", "text"), ("target", "text"), ("destination", "text")]),
    ("idem_outbox_fetch", [("topic", "text"), ("count", "integer"), ("flease", "interval"),
                           ("count", "integer")]),
    ("idem_outbox_fetch", [("topic", "text"), ("count", "integer")]),
    ("idem_outbox_ack", [("ids", "bigint[]")]),
    ("idem_outbox_ack", [("ids", "bigint[]"), ("attempts", "integer[]")]),
    ("idem_outbox_nack", [("id", "bigint"), ("text", "text")]),
    ("idem_outbox_nack", [("id", "bigint"), ("text", "text"), ("attempt", "integer")]),
    ("idem_outbox_requeue", [("id", "bigint")]),
    ("idem_outbox_discard", [("id", "bigint")]),
]
FUNCTIONS = [f for f in FUNCTIONS if f[0] not in EXCLUDED["functions"]]


class Pair:
    """One session of the sequence: a connection to each edition."""

    def __init__(self, label, dsns):
        self.label = label
        self.conns = [connect(dsn) for dsn in dsns]
        for conn in self.conns:
            for sql in ("SET client_min_messages = warning", "SET lock_timeout = '100ms'",
                        "SET statement_timeout = '60s'", "SET TimeZone = 'UTC'") + SESSION_SETTINGS:
                conn.execute(sql)
        self.in_tx = self.aborted = False
        self.savepoints = 0


def connect(dsn):
    """A connection whose json and jsonb come back as the server's text: the
    editions' outputs are compared as they are, and a hostile value nested
    thousands deep is no parse for Python's json module to recurse on."""
    conn = psycopg.connect(dsn, autocommit=True)
    for name in ("json", "jsonb"):
        conn.adapters.register_loader(name, TextLoader)
    return conn


def normalize(value):
    if isinstance(value, (datetime.datetime, datetime.date)):
        return "<time>"
    if isinstance(value, (list, tuple)):
        return [normalize(v) for v in value]
    if isinstance(value, memoryview):
        return bytes(value)
    return value


def run(conn, sql):
    try:
        cur = conn.execute(sql)
        if cur.description is None:
            return ("ok", cur.statusmessage)
        names = [d.name for d in cur.description]
        return ("rows", names, [normalize(tuple(row)) for row in cur.fetchall()])
    except psycopg.Error as e:
        if e.diag.sqlstate is None:
            raise
        return ("error", e.diag.sqlstate, e.diag.message_primary)


def statement(rng, values, session):
    """The next statement of a session, and how it changes its state."""
    roll = rng.random()
    if session.aborted and roll < 0.6:
        if session.savepoints and rng.random() < 0.5:
            return f"ROLLBACK TO SAVEPOINT s{session.savepoints}", "rollback-to"
        return "ROLLBACK", "end"
    if not session.in_tx and roll < 0.08:
        return rng.choice(["BEGIN", "BEGIN", "BEGIN READ ONLY"]), "begin"
    if session.in_tx and roll < 0.18:
        choices = ["COMMIT", "ROLLBACK", "SAVEPOINT"]
        if session.savepoints:
            choices += ["ROLLBACK TO SAVEPOINT", "RELEASE SAVEPOINT"]
        what = rng.choice(choices)
        if what == "SAVEPOINT":
            return f"SAVEPOINT s{session.savepoints + 1}", "savepoint"
        if what == "ROLLBACK TO SAVEPOINT":
            return f"ROLLBACK TO SAVEPOINT s{session.savepoints}", "rollback-to"
        if what == "RELEASE SAVEPOINT":
            return f"RELEASE SAVEPOINT s{session.savepoints}", "release"
        return what, "end"
    if roll < 0.22:
        name = rng.choice(sorted(SETTINGS))
        if rng.random() < 0.3:
            return f"RESET {name}", None
        return (f"SELECT FROM (SELECT set_config('{name}', {rng.choice(SETTINGS[name])}, "
                f"{rng.choice(['true', 'false'])})) AS s", None)
    name, args = rng.choice(FUNCTIONS)
    p_hostile = rng.choice([0.0, 0.0, 0.1, 0.3])
    chosen = [values.pick(kind, sql_type, p_hostile) for kind, sql_type in args]
    return f"SELECT * FROM idempotency.{name}({', '.join(chosen)})", None


def apply_state(session, change, outcome):
    if session.in_tx and outcome[0] == "error":
        session.aborted = True
    if change == "rollback-to" and outcome[0] == "ok":
        session.aborted = False
    if change == "begin" and outcome[0] == "ok":
        session.in_tx, session.savepoints = True, 0
    elif change == "end":
        session.in_tx, session.savepoints, session.aborted = False, 0, False
    elif change == "savepoint" and outcome[0] == "ok":
        session.savepoints += 1
    elif change == "release" and outcome[0] == "ok":
        session.savepoints -= 1
    # ROLLBACK TO keeps the savepoint


def main():
    dsns = [os.environ["DIFF_C_DSN"], os.environ["DIFF_SQL_DSN"]]
    rng = random.Random(SEED)
    values = Values(rng)
    print(f"diff_editions: seed {SEED} (FUZZ_SEED={SEED} repeats it), {SECONDS:g} s")
    for dsn in dsns:
        with connect(dsn) as conn:
            conn.execute("DELETE FROM idempotency.keys")
            conn.execute("DELETE FROM idempotency.processed_events")
            conn.execute("DELETE FROM idempotency.outbox")
            conn.execute("DELETE FROM idempotency.outbox_routes")
            conn.execute("SELECT setval('idempotency.outbox_id_seq', 1, false)")
    sessions = [Pair("A", dsns), Pair("B", dsns)]
    history = []
    counts = {"ok": 0, "rows": 0, "error": 0}
    errors = {}
    start = time.monotonic()
    steps = 0
    slow = []
    while steps < STEPS and time.monotonic() - start < SECONDS:
        steps += 1
        session = rng.choice(sessions)
        sql, change = statement(rng, values, session)
        outcomes = []
        for i, conn in enumerate(session.conns):
            t0 = time.monotonic()
            outcomes.append(run(conn, sql))
            slow.append((time.monotonic() - t0, ("C", "SQL")[i], sql[:200]))
        slow = sorted(slow, reverse=True)[:8]
        history.append(f"{session.label}: {sql}")
        if VERBOSE:
            print(history[-1], "->", outcomes[0])
        if outcomes[0] != outcomes[1]:
            print(f"diff_editions: the editions differ at step {steps} (seed {SEED})")
            print("statements, session: SQL (the last 60):")
            for line in history[-60:]:
                print("  " + (line if len(line) < 400 else line[:400] + " ..."))
            print(f"C edition:   {outcomes[0]!r}"[:2000])
            print(f"SQL edition: {outcomes[1]!r}"[:2000])
            return 1
        counts[outcomes[0][0]] += 1
        if outcomes[0][0] == "error":
            errors[outcomes[0][1]] = errors.get(outcomes[0][1], 0) + 1
        apply_state(session, change, outcomes[0])
    print(f"diff_editions: {steps} statements in {time.monotonic() - start:.0f} s, the same on both "
          f"editions: {counts['rows']} with rows, {counts['ok']} commands, {counts['error']} errors "
          f"({', '.join(f'{k} {v}' for k, v in sorted(errors.items()))})")
    for line in slow[:8 if VERBOSE else 1]:
        print("diff_editions: slowest: %.2f s on the %s edition: %s" % line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
