#!/usr/bin/env python3
"""make bench: the extension side by side with plain SQL, in one run.

Starts a throwaway cluster (shared_buffers 256MB, max_wal_size 4GB, fsync and
synchronous_commit on: a normal durable server) with the library preloaded,
runs every workload with pgbench -M prepared, 8 clients (1 for the
batch against its single calls: one consumer), BENCH_SECONDS (15)
seconds, three rounds, ours and the reference alternating within each round
so that machine drift cancels out, each run after a VACUUM of the tables
(autovacuum leaves them alone meanwhile) and a CHECKPOINT, and prints a table
(tps, latency, ratio; the median of the rounds) with each round's ratio.
The ratio is the median of the rounds' ratios, each of a round's two runs
against the other.
Then the background worker: publishing while 8 clients enqueue, and purging
a million expired keys, three times, the second time while 8 clients claim
(their per-second tps while the purge runs, against the quiet seconds before
and after it).  The last line printed is one JSON
object with the headline ratios (ours / reference: higher is better).

Then idem_claim's wait, in a cluster of its own (max_connections 1100): how
soon a waiter answers once its holder commits, with 100 waiters on one key
and with 1,000 waiters on 1,000 keys; and claim + complete with 1,000
waiters parked, against the same without them.

Environment: BENCH_SECONDS, BENCH_ROUNDS, BENCH_PUBLISH_SECONDS, BENCH_PURGE_ROWS,
BENCH_WAITERS (1000), BENCH_PARTS (a subset of
pairs,shapes,publish,wait,purge,outbox,endtoend,cold,routes), BENCH_E2E_SECONDS (30),
BENCH_COLD_ROWS (50000), BENCH_ROUTE_ROWS (50000), BENCH_EDITION_LINES (EDITION=sql: a subset of
replay,claim_complete,mark_processed,enqueue,drain),
BENCH_PAIRS (names of
the pairs to run, comma-separated; all by default), BENCH_EXTRA_CONF
(postgresql.conf lines for the cluster, separated by ';'), PG_CONFIG.
"""

import json
import os
import pwd
import re
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOADS = os.path.join(HERE, "workloads")
SECONDS = int(os.environ.get("BENCH_SECONDS", "15"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
PUBLISH_SECONDS = int(os.environ.get("BENCH_PUBLISH_SECONDS", "60"))
CLIENTS = 8
THREADS = 2
PURGE_ROWS = int(os.environ.get("BENCH_PURGE_ROWS", "1000000"))
PARTS = os.environ.get("BENCH_PARTS",
                       "pairs,shapes,publish,wait,purge,outbox,endtoend,cold,routes").split(",")
WAITERS = int(os.environ.get("BENCH_WAITERS", "1000"))

# (name in the JSON, our script, the reference script, the bar (None: the
# figure is printed without one), and pgbench's options when not 8 clients)
# The replay pair goes first, while the keys table holds the same 100,000
# stored responses as its reference: the claims of the other pairs grow it
# several times over, past what shared_buffers holds beside the reference.
PAIRS = [
    ("replay_vs_pk_select", "replay.sql", "pk_select.sql", 0.90),
    ("claim_complete_vs_floor", "claim_complete.sql", "floor.sql", 0.90),
    ("claim_complete_vs_plpgsql", "claim_complete.sql", "plpgsql.sql", 1.30),
    ("mark_processed_vs_insert", "mark_processed.sql", "insert_events.sql", 0.95),
    ("enqueue_vs_insert", "enqueue.sql", "insert_outbox.sql", 0.90),
    # 500 new event ids per transaction on every side: tps ratio = events/s ratio
    ("mark_batch_vs_insert", "mark_processed_batch.sql", "insert_events_batch.sql", 0.90),
    # one consumer, who waits for each of the 500 round trips: the shape the
    # batch is for
    ("mark_batch_vs_single", "mark_processed_batch.sql", "mark_processed_500.sql", 10.0,
     {"clients": 1}),
    # the same with 8 clients, without a bar: on a few cores the single
    # calls' round trips cost only their CPU, the other clients' work
    # filling their waits (issue 19)
    ("mark_batch_vs_single_8_clients", "mark_processed_batch.sql", "mark_processed_500.sql",
     None),
]

# EDITION=sql: the SQL edition (make dist's script, which scripts/bench.sh
# builds and names in BENCH_SQL_EDITION) against the C edition, in the same
# run: the lines of bench_edition, each with its ratio SQL / C
EDITION = os.environ.get("EDITION", "c")
SQL_EDITION_SCRIPT = os.environ.get("BENCH_SQL_EDITION", "")
EDITION_LINES = [
    ("replay", "replay.sql"),
    ("claim_complete", "claim_complete.sql"),
    ("mark_processed", "mark_processed.sql"),
    ("enqueue", "enqueue.sql"),
]
# BENCH_EDITION_LINES: a subset of the names above and "drain"
EDITION_WANTED = os.environ.get("BENCH_EDITION_LINES",
                                ",".join([n for n, _ in EDITION_LINES] + ["drain"])).split(",")

PG_CONFIG = os.environ.get("PG_CONFIG", "/usr/lib/postgresql/15/bin/pg_config")
PGBIN = subprocess.run([PG_CONFIG, "--bindir"], capture_output=True, text=True,
                       check=True).stdout.strip()
AS_RUNNER = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


class Cluster:
    """A throwaway cluster on a unix socket, removed on exit."""

    def __init__(self, extra_conf="", port_offset=0, preload=True):
        self.dir = tempfile.mkdtemp(prefix="idempotency-bench.")
        os.chmod(self.dir, 0o755)
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self.port = 20000 + (os.getpid() + port_offset) % 20000
        self.run([f"{PGBIN}/initdb", "-D", f"{self.dir}/data", "-A", "trust",
                  "-U", "postgres", "--no-sync"], quiet=True)
        with open(f"{self.dir}/data/postgresql.conf", "a") as conf:
            conf.write(("shared_preload_libraries = 'idempotency'\n"
                        "idempotency.naptime = '100ms'\n" if preload else "") + f"""
listen_addresses = ''
unix_socket_directories = '{self.dir}'
port = {self.port}
shared_buffers = 256MB
fsync = on
synchronous_commit = on
max_connections = 100
max_wal_size = 4GB
# the waiters' part parks claims for the whole of a pgbench run
idempotency.max_wait = '10min'
""" + os.environ.get("BENCH_EXTRA_CONF", "").replace(";", "\n") + "\n" + extra_conf)
        self.run([f"{PGBIN}/pg_ctl", "-D", f"{self.dir}/data", "-l",
                  f"{self.dir}/server.log", "-w", "start"], quiet=True)

    def run(self, argv, quiet=False, env=None):
        result = subprocess.run(AS_RUNNER + argv, capture_output=True, text=True,
                                env=env)
        if result.returncode != 0:
            sys.stderr.write(result.stdout + result.stderr)
            raise SystemExit(f"failed: {' '.join(argv)}")
        return result.stdout

    def psql(self, sql):
        return self.run([f"{PGBIN}/psql", "-X", "-q", "-At", "-v", "ON_ERROR_STOP=1",
                         "-h", self.dir, "-p", str(self.port), "-U", "postgres",
                         "-d", "postgres", "-c", sql]).strip()

    def psql_file(self, path):
        self.run([f"{PGBIN}/psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", self.dir,
                  "-p", str(self.port), "-U", "postgres", "-d", "postgres", "-f", path])

    def pgbench(self, script, seconds, clients=CLIENTS, options=None):
        env = dict(os.environ)
        if options:
            env["PGOPTIONS"] = options
        out = self.run([f"{PGBIN}/pgbench", "-n", "-M", "prepared", "-c", str(clients),
                        "-j", str(min(THREADS, clients)), "-T", str(seconds),
                        "-f", os.path.join(WORKLOADS, script), "-h", self.dir,
                        "-p", str(self.port), "-U", "postgres", "postgres"], env=env)
        tps = float(re.search(r"tps = ([\d.]+) \(without initial connection time\)", out)[1])
        latency = float(re.search(r"latency average = ([\d.]+) ms", out)[1])
        return tps, latency

    def pgbench_progress(self, script, clients=CLIENTS):
        """pgbench in the background, reporting its tps every second until
        stopped."""
        return Progress(self.run_async([f"{PGBIN}/pgbench", "-n", "-M", "prepared",
                                         "-c", str(clients), "-j", str(min(THREADS, clients)),
                                         "-T", "3600", "-P", "1", "--progress-timestamp",
                                         "-f", os.path.join(WORKLOADS, script), "-h", self.dir,
                                         "-p", str(self.port), "-U", "postgres", "postgres"]))

    def session(self):
        """One psql session kept open, for polling: a psql started per poll
        costs a connection's start-up, which a poll every 50 ms would take
        from the clients being measured."""
        return Session(self.run_async([f"{PGBIN}/psql", "-X", "-q", "-At", "-v", "ON_ERROR_STOP=1",
                                       "-h", self.dir, "-p", str(self.port), "-U", "postgres",
                                       "-d", "postgres"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE))

    def run_async(self, argv, **kwargs):
        kwargs.setdefault("stdout", subprocess.DEVNULL)
        kwargs.setdefault("stderr", subprocess.PIPE)
        return subprocess.Popen(AS_RUNNER + argv, text=True, **kwargs)

    def log_problems(self, last=10):
        """The server log's ERROR, WARNING, FATAL and PANIC lines, the last
        few: a worker that fell behind may have failed batches meanwhile."""
        if not os.path.exists(f"{self.dir}/server.log"):
            return 0, []
        with open(f"{self.dir}/server.log", errors="replace") as log:
            lines = [line.rstrip() for line in log
                     if re.search(r"\b(ERROR|WARNING|FATAL|PANIC):", line)]
        return len(lines), lines[-last:]

    def stop(self):
        subprocess.run(AS_RUNNER + [f"{PGBIN}/pg_ctl", "-D", f"{self.dir}/data",
                                    "-m", "fast", "stop"], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)


class Session:
    """A psql reading queries from its stdin; each runs in a transaction of
    its own."""

    def __init__(self, process):
        self.process = process

    def query(self, sql):
        self.process.stdin.write(sql.rstrip().rstrip(";") + ";\n\\echo ~~~\n")
        self.process.stdin.flush()
        lines = []
        for line in self.process.stdout:
            if line.rstrip("\n") == "~~~":
                return "\n".join(lines)
            lines.append(line.rstrip("\n"))
        raise SystemExit(f"psql session ended: {self.process.stderr.read()}")

    def close(self):
        self.process.stdin.close()
        self.process.wait()


class Progress:
    """The per-second reports of a pgbench run in the background."""

    def __init__(self, process):
        self.process = process
        self.reports = []
        self.reader = threading.Thread(target=self.read, daemon=True)
        self.reader.start()

    def read(self):
        for line in self.process.stderr:
            match = re.match(r"progress: ([\d.]+) s, ([\d.]+) tps", line)
            if match:
                self.reports.append((float(match[1]), float(match[2])))

    def stop(self):
        """Stops pgbench; returns (unix time, tps over the second before)."""
        self.process.terminate()
        self.process.wait()
        self.reader.join()
        return self.reports


# The tables the pairs write, ours and the references'.  While the pairs run,
# autovacuum leaves them alone and compare() vacuums them all before every
# run instead, as pgbench does its own tables: otherwise a vacuum that one
# side's rows called for (and the page images it writes after the
# checkpoint) lands in whichever run happens to be going, as often the
# other side's as its own.
PAIR_TABLES = ["idempotency.keys", "idempotency.processed_events", "idempotency.outbox",
               "bench_floor", "bench_replay", "peer_keys", "bench_events", "bench_outbox"]


def pair_tables_autovacuum(cluster, on):
    cluster.psql("; ".join(f"ALTER TABLE {table} RESET (autovacuum_enabled)" if on else
                           f"ALTER TABLE {table} SET (autovacuum_enabled = off)"
                           for table in PAIR_TABLES))


def cpu_times():
    """The machine's CPU time so far, all cores: (stolen, total), in ticks.
    Stolen is the time the hypervisor gave this virtual machine's cores to
    someone else while they had work: on a shared host it comes in bursts
    of seconds, and one in a run slows that run alone."""
    with open("/proc/stat") as stat:
        ticks = [int(n) for n in stat.readline().split()[1:9]]
    return ticks[7], sum(ticks)


def steal_share(before, after):
    """The percentage of the CPU time between two cpu_times() that was stolen."""
    total = after[1] - before[1]
    return 100.0 * (after[0] - before[0]) / total if total else 0.0


def machine():
    """Cores, memory, CPU model and kernel, for the header."""
    with open("/proc/cpuinfo") as info:
        model = next((line.split(":", 1)[1].strip() for line in info
                      if line.startswith("model name")), "unknown CPU")
    with open("/proc/meminfo") as info:
        memory = int(info.readline().split()[1]) / 2**20
    kernel = subprocess.run(["uname", "-sr"], capture_output=True, text=True).stdout.strip()
    return f"{os.cpu_count()} cores ({model}), {memory:.0f} GB, {kernel}"


def load():
    """The machine's load averages (1, 5, 15 minutes): other work on it
    slows whichever run it lands in."""
    with open("/proc/loadavg") as loadavg:
        return " ".join(loadavg.read().split()[:3])


def compare(cluster, ours, reference, seconds=SECONDS, rounds=ROUNDS, **kwargs):
    """Rounds of ours and the reference, alternating which goes first; each
    run starts from vacuumed tables and a checkpoint.  Returns the median
    tps and latency of each side, each round's ratio, and the ratio: the
    median of the rounds' ratios.  The two runs of a round follow each
    other, so a drift of the machine's speed cancels out of their ratio;
    the median tps of either side may come from different rounds, and their
    ratio would carry the drift between them."""
    results = {"ours": [], "ref": []}
    steal = {"ours": [], "ref": []}
    for round_no in range(rounds):
        order = [("ours", ours), ("ref", reference)]
        if round_no % 2:
            order.reverse()
        for side, script in order:
            cluster.psql(f"VACUUM (ANALYZE) {', '.join(PAIR_TABLES)}")
            cluster.psql("CHECKPOINT")
            before = cpu_times()
            results[side].append(cluster.pgbench(script, seconds, **kwargs))
            steal[side].append(steal_share(before, cpu_times()))
    median = {side: (statistics.median(t for t, _ in runs),
                     statistics.median(l for _, l in runs))
              for side, runs in results.items()}
    ratios = [ours_tps / ref_tps for (ours_tps, _), (ref_tps, _)
              in zip(results["ours"], results["ref"])]
    median["rounds"] = " ".join(f"{r:.2f}" for r in ratios)
    median["steal"] = " ".join(f"{o:.0f}/{r:.0f}" for o, r in zip(steal["ours"], steal["ref"]))
    return median, statistics.median(ratios)


def bench_publish(cluster):
    """8 clients enqueue for PUBLISH_SECONDS while the worker publishes to a
    function; sample the backlog every second."""
    backlog = []
    done = threading.Event()

    # the rows not published yet, through outbox_ready: a count of the
    # topic's rows read the whole primary key each second, every row
    # published since the last vacuum again, as long as it took
    # ; and, after it, the entries of outbox_ready that count read, which
    # are taken off those read by everyone (the worker's walks are the rest):
    # without parallel workers, whose counts are theirs
    backlog_sql = ("SET max_parallel_workers_per_gather = 0;"
                   " SELECT n || ' ' || pg_stat_get_xact_tuples_returned('idempotency.outbox_ready'::regclass)"
                   " FROM (SELECT count(*) AS n FROM idempotency.outbox"
                   "       WHERE topic = 'published' AND published_at IS NULL) c")
    ready_read_sql = ("SELECT idx_tup_read FROM pg_stat_user_indexes"
                      " WHERE indexrelid = 'idempotency.outbox_ready'::regclass")
    sampler_read = [0]

    def count_backlog():
        n, read = (int(x) for x in cluster.psql(backlog_sql).split())
        sampler_read[0] += read
        return n

    def sample():
        while not done.wait(1.0):
            backlog.append(count_backlog())

    ready_read_before = int(cluster.psql(ready_read_sql))
    published_before = int(cluster.psql("SELECT count(*) FROM sink"))
    sampler = threading.Thread(target=sample)
    sampler.start()
    tps, _ = cluster.pgbench("enqueue_published.sql", PUBLISH_SECONDS)
    done.set()
    sampler.join()
    time.sleep(2)
    drained = count_backlog()
    # the worker sends its counts at most once a second, between batches
    # or naps (naptime 1 s): wait for the last of them
    time.sleep(1.5)
    published = int(cluster.psql("SELECT count(*) FROM sink")) - published_before
    worker_read = int(cluster.psql(ready_read_sql)) - ready_read_before - sampler_read[0]
    p50, p99 = (float(x) for x in cluster.psql(
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY ms) || '|' ||"
        "       percentile_cont(0.99) WITHIN GROUP (ORDER BY ms)"
        " FROM (SELECT extract(epoch FROM published_at - created_at) * 1000 AS ms FROM sink) s"
    ).split("|"))
    half = len(backlog) // 2
    first, second = backlog[:half] or [0], backlog[half:] or [0]
    # flat: the second half's backlog is no larger than the first half's
    # (allowing noise of a few batches), and it drains once enqueueing stops
    keeps_up = max(second) <= max(first) * 1.5 + 100 and drained == 0
    failures = int(cluster.psql("SELECT publish_failures FROM idempotency.idem_stats_counters()"))
    return {"tps": tps, "failures": failures, "backlog_max": max(backlog or [0]), "backlog_last": (backlog or [0])[-1],
            "drained": drained, "p50": p50, "p99": p99, "keeps_up": keeps_up,
            "ready_read_per_row": worker_read / max(published, 1)}


# --- the outbox's batch calls and pull API (issue 19) -----------------------

DRAIN_ROWS = int(os.environ.get("BENCH_DRAIN_ROWS", "50000"))
HOT_KEY_ROWS = int(os.environ.get("BENCH_HOT_KEY_ROWS", "20000"))


def fill_drain(cluster, topic, rows, keys):
    """rows ready outbox rows of topic, with keys distinct keys in turn (0:
    none), and the same rows in bench_drain, the floor's table."""
    key = "NULL" if keys == 0 else f"(SELECT array_agg('k' || n % {keys}) FROM generate_series(1, {rows}) n)"
    cluster.psql(f"TRUNCATE idempotency.outbox, bench_drain; "
                 f"SELECT count(*) FROM idempotency.idem_outbox_enqueue_batch('{topic}', "
                 f"array_fill('{{\"order_id\": 123456, \"status\": \"created\"}}'::jsonb, ARRAY[{rows}]), {key}); "
                 f"INSERT INTO bench_drain SELECT * FROM idempotency.outbox")
    cluster.psql("VACUUM (ANALYZE) idempotency.outbox, bench_drain")
    cluster.psql("CHECKPOINT")


def drain_once(cluster, script, batches, per_key=1, options=None):
    """One relay (one client) running script batches times; returns batches
    a second."""
    env = dict(os.environ)
    if options:
        env["PGOPTIONS"] = options
    out = cluster.run([f"{PGBIN}/pgbench", "-n", "-M", "prepared", "-c", "1", "-t", str(batches),
                       "-D", f"per_key={per_key}", "-f", os.path.join(WORKLOADS, script),
                       "-h", cluster.dir, "-p", str(cluster.port), "-U", "postgres", "postgres"],
                      env=env)
    return float(re.search(r"tps = ([\d.]+) \(without initial connection time\)", out)[1])


def bench_drain(cluster, keys):
    """One relay drains DRAIN_ROWS ready rows in batches of 100, fetch then
    ack (each in autocommit), against the plain-SQL floor of the same shape
    (UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED LIMIT 100)
    RETURNING, then DELETE ... WHERE id = ANY), ROUNDS rounds alternating.
    Returns the median batches/s of each and the median of the rounds'
    ratios."""
    batches = DRAIN_ROWS // 100
    ours, floor, ratios = [], [], []
    for round_no in range(ROUNDS):
        results = {}
        for side in (["ours", "floor"] if round_no % 2 == 0 else ["floor", "ours"]):
            fill_drain(cluster, "drain", DRAIN_ROWS, keys)
            results[side] = drain_once(cluster, "drain.sql" if side == "ours" else "drain_floor.sql",
                                       batches)
            left = int(cluster.psql("SELECT count(*) FROM idempotency.outbox" if side == "ours"
                                    else "SELECT count(*) FROM bench_drain"))
            if left:
                raise SystemExit(f"the {side} drain left {left} rows")
        ours.append(results["ours"])
        floor.append(results["floor"])
        ratios.append(results["ours"] / results["floor"])
    return statistics.median(ours), statistics.median(floor), ratios


def bench_hot_key(cluster):
    """One relay drains one hot key, per_key 100 against per_key 1, acked
    rows kept as published (outbox_retention 1h) so that the order in which
    each key's rows were acknowledged can be checked afterwards: a row's
    published_at is never earlier than the one before it of its key."""
    options = "-c idempotency.outbox_retention=1h"
    # the worker's purge too keeps them (its retention is the server's)
    cluster.psql("ALTER SYSTEM SET idempotency.outbox_retention = '1h'")
    cluster.psql("SELECT pg_reload_conf()")
    rates = {}
    for per_key, batches in ((100, HOT_KEY_ROWS // 100), (1, HOT_KEY_ROWS // 10)):
        fill_drain(cluster, "drain", HOT_KEY_ROWS, 1)
        per_second = drain_once(cluster, "drain.sql", batches, per_key=per_key, options=options)
        # the rows acknowledged: all but those left unpublished (a purge
        # removes published rows only)
        rows = HOT_KEY_ROWS - int(cluster.psql(
            "SELECT count(*) FROM idempotency.outbox WHERE state <> 'published'"))
        rates[per_key] = per_second * rows / batches
        out_of_order = int(cluster.psql(
            "SELECT count(*) FROM (SELECT published_at < lag(published_at) OVER (PARTITION BY key ORDER BY id) AS wrong"
            " FROM idempotency.outbox WHERE topic = 'drain') s WHERE wrong"))
        gaps = int(cluster.psql(
            "SELECT count(*) FROM idempotency.outbox p WHERE state = 'published' AND EXISTS ("
            " SELECT FROM idempotency.outbox e WHERE e.topic = p.topic AND e.key = p.key"
            " AND e.id < p.id AND e.state <> 'published')"))
        if out_of_order or gaps:
            raise SystemExit(f"per_key {per_key}: {out_of_order} rows acknowledged before an earlier row"
                             f" of their key, {gaps} published ahead of an unpublished one")
    cluster.psql("ALTER SYSTEM RESET idempotency.outbox_retention")
    cluster.psql("SELECT pg_reload_conf()")
    return rates


def bench_outbox(cluster, summary):
    print("\n== outbox: enqueue_batch, and one relay draining with the pull API", flush=True)
    cluster.psql("CREATE TABLE IF NOT EXISTS bench_drain (LIKE idempotency.outbox INCLUDING DEFAULTS"
                 " INCLUDING CONSTRAINTS); ALTER TABLE bench_drain DROP CONSTRAINT IF EXISTS bench_drain_pkey;"
                 " ALTER TABLE bench_drain ADD PRIMARY KEY (topic, id)")
    pair_tables_autovacuum(cluster, False)
    cluster.psql("ALTER TABLE bench_drain SET (autovacuum_enabled = off)")
    median, ratio = compare(cluster, "enqueue_batch.sql", "insert_outbox_unnest.sql")
    print(f"enqueue_batch of 100 vs INSERT ... SELECT unnest: ours {median['ours'][0]:.0f} calls/s, "
          f"insert {median['ref'][0]:.0f}/s, ratio {ratio:.2f} (bar 0.90, "
          f"{'ok' if ratio >= 0.9 else 'MISS'}); rounds {median['rounds']}", flush=True)
    summary["enqueue_batch_vs_insert_unnest"] = round(ratio, 3)
    cluster.psql("TRUNCATE idempotency.outbox, bench_outbox")
    for keys, name in ((0, "drain_vs_floor"), (1000, "drain_1000_keys_vs_floor")):
        ours, floor, ratios = bench_drain(cluster, keys)
        ratio = statistics.median(ratios)
        print(f"drain {DRAIN_ROWS} rows, {'no keys' if keys == 0 else f'{keys} keys'}, batches of 100:"
              f" ours {ours:.0f} batches/s ({1000 / ours:.2f} ms), floor {floor:.0f} batches/s"
              f" ({1000 / floor:.2f} ms), ratio {ratio:.2f} (bar 0.80, {'ok' if ratio >= 0.8 else 'MISS'});"
              f" rounds {' '.join(f'{r:.2f}' for r in ratios)}", flush=True)
        summary[name] = round(ratio, 3)
    rates = bench_hot_key(cluster)
    ratio = rates[100] / rates[1]
    print(f"one hot key: per_key 100 {rates[100]:.0f} rows/s, per_key 1 {rates[1]:.0f} rows/s,"
          f" ratio {ratio:.1f} (bar 20, {'ok' if ratio >= 20 else 'MISS'}); every key's order"
          f" checked", flush=True)
    summary["hot_key_per_key_100_vs_1"] = round(ratio, 1)
    cluster.psql("TRUNCATE idempotency.outbox, bench_drain")
    pair_tables_autovacuum(cluster, True)


# --- a relay that keeps up, whatever the statistics say (issue 29, item 8) ---

E2E_SECONDS = int(os.environ.get("BENCH_E2E_SECONDS", "30"))
E2E_PRODUCERS = 4
E2E_RELAY_AFTER = 5
COLD_ROWS = int(os.environ.get("BENCH_COLD_ROWS", "50000"))
BENCH_PAYLOAD = ('{"order_id": 123456, "customer": {"id": 987654, "name": "Alice Example",'
                 ' "email": "alice@example.com"}, "items": [{"sku": "SKU-0001", "qty": 2,'
                 ' "price": 19.99}, {"sku": "SKU-0002", "qty": 1, "price": 5.49}],'
                 ' "total": 45.47, "currency": "EUR", "status": "created", "note": "leave at the door"}')


def bench_end_to_end(cluster, summary):
    """E2E_PRODUCERS clients enqueue single events (the pairs' payload, 1,000
    keys) for E2E_SECONDS; E2E_RELAY_AFTER seconds in, one relay connects
    and fetches batches of 100 and acknowledges them, fenced, each in
    autocommit, as fast as it can (a relay restarted under load);
    autovacuum on (naptime 5 s, so that it visits the outbox during a
    round).  Each round starts from an empty outbox whose statistics say
    so (an ANALYZE of it empty), and a new relay connection.  The backlog
    is the rows not acknowledged when the producers stop; the goal: at most
    two batches, in every round."""
    print(f"\n== end to end: {E2E_PRODUCERS} producers enqueue for {E2E_SECONDS} s, one relay"
          f" from {E2E_RELAY_AFTER} s in fetches 100 + acks (fenced); autovacuum on (naptime 5 s); goal: backlog at the end"
          " <= 200 rows in every round", flush=True)
    cluster.psql("ALTER SYSTEM SET autovacuum_naptime = '5s'")
    cluster.psql("SELECT pg_reload_conf()")
    cluster.psql("ALTER TABLE idempotency.outbox RESET (autovacuum_enabled)")
    backlogs = []
    for round_no in range(ROUNDS):
        cluster.psql("TRUNCATE idempotency.outbox")
        cluster.psql("ANALYZE idempotency.outbox")
        cluster.psql("CHECKPOINT")
        counts = "SELECT coalesce(sum(autovacuum_count), 0) || '|' || coalesce(sum(autoanalyze_count), 0)" \
                 " FROM pg_stat_user_tables WHERE relid = 'idempotency.outbox'::regclass"
        before = [int(n) for n in cluster.psql(counts).split("|")]
        # not cluster.pgbench: a producer's failure is reported, and the
        # round measured all the same
        producers = cluster.run_async([f"{PGBIN}/pgbench", "-n", "-M", "prepared",
                                       "-c", str(E2E_PRODUCERS), "-j", str(THREADS),
                                       "-T", str(E2E_SECONDS),
                                       "-f", os.path.join(WORKLOADS, "enqueue_e2e.sql"),
                                       "-h", cluster.dir, "-p", str(cluster.port), "-U", "postgres",
                                       "postgres"], stdout=subprocess.PIPE)
        # the relay (re)connects once the producers have run for a while:
        # its first fetches meet a backlog, as after a relay's restart
        time.sleep(E2E_RELAY_AFTER)
        relay = cluster.run_async([f"{PGBIN}/pgbench", "-n", "-M", "prepared", "-c", "1",
                                   "-T", str(E2E_SECONDS + 600),
                                   "-f", os.path.join(WORKLOADS, "relay_e2e.sql"), "-h", cluster.dir,
                                   "-p", str(cluster.port), "-U", "postgres", "postgres"])
        try:
            out, err = producers.communicate()
            backlog = int(cluster.psql("SELECT count(*) FROM idempotency.outbox"
                                       " WHERE topic = 'e2e' AND state <> 'published'"))
        finally:
            relay.terminate()
            relay.wait()
        relay_errors = [line for line in relay.stderr.read().splitlines() if "error" in line.lower()]
        producer_errors = [line for line in err.splitlines() if "error" in line.lower()]
        processed = re.search(r"number of transactions actually processed: (\d+)", out)
        after = [int(n) for n in cluster.psql(counts).split("|")]
        backlogs.append(backlog)
        print(f"round {round_no + 1}: enqueued {int(processed[1]) / E2E_SECONDS if processed else 0:.0f}"
              f" events/s; backlog at the end {backlog}"
              f" ({'ok' if backlog <= 200 else 'MISS'}); autovacuum {after[0] - before[0]},"
              f" autoanalyze {after[1] - before[1]} times meanwhile", flush=True)
        for who, errors in (("a producer", producer_errors), ("the relay", relay_errors)):
            if errors:
                print(f"   {who} failed: {errors[0]}", flush=True)
    print(f"backlog at the end of each round: {' '.join(str(b) for b in backlogs)}"
          f" (goal <= 200 in every round: {'ok' if max(backlogs) <= 200 else 'MISS'})", flush=True)
    summary["e2e_backlog_max"] = max(backlogs)
    cluster.psql("ALTER SYSTEM RESET autovacuum_naptime")
    cluster.psql("SELECT pg_reload_conf()")
    cluster.psql("TRUNCATE idempotency.outbox")


def fill_cold(cluster, rows):
    """rows events of topic cold, the pairs' payload, by enqueue_batch of 100,
    each row's key one of 1,000 in turn."""
    cluster.psql(f"SELECT count(*) FROM generate_series(0, {rows // 100 - 1}) b,"
                 f" LATERAL idempotency.idem_outbox_enqueue_batch('cold',"
                 f" array_fill('{BENCH_PAYLOAD}'::jsonb, ARRAY[100]),"
                 f" (SELECT array_agg('order-' || (b * 100 + n) % 1000) FROM generate_series(0, 99) n))")


COLD_FETCH = "SELECT id, attempts FROM idempotency.idem_outbox_fetch('cold', 100, '30 seconds')"
PLAIN_FETCH = ("WITH c AS (SELECT id FROM idempotency.outbox"
               " WHERE topic = 'cold' AND state = 'pending' AND published_at IS NULL"
               " ORDER BY topic, id LIMIT 100 FOR UPDATE SKIP LOCKED)"
               " UPDATE idempotency.outbox o SET state = 'leased', attempts = o.attempts + 1,"
               " available_at = now() + interval '30 seconds'"
               " FROM c WHERE o.id = c.id RETURNING o.id, o.attempts")


def bench_cold_relay(cluster, summary):
    """A relay's fetch of 100 (each acknowledged after, untimed) on a
    backlog of COLD_ROWS: steady (the median of 50 calls on a connection
    that made 20 before), a new connection's first call and the slowest of
    its first five (the median over ten connections), and the same after
    stale statistics (an ANALYZE of the outbox with 3 rows in it, then the
    backlog enqueued; the median over five connections), and the calls
    11 to 30 of a connection then, on the plan it keeps.  Each against the
    steady fetch; the goal: at most 2x.  For scale, a new connection's
    first fetch of an empty topic (the backend's own start: its caches,
    the statements prepared), and the first fetch of the backlog after it
    (the plans, which were custom ones for a connection's first five
    calls).  Timed by the client, over the Unix
    socket, with the statement sent unprepared every time (psycopg's
    automatic preparation off), the same for every call.  Then the bytes
    per outbox row: pg_total_relation_size after the COLD_ROWS rows."""
    import psycopg
    conninfo = dict(host=cluster.dir, port=cluster.port, user="postgres", dbname="postgres",
                    autocommit=True)

    def connect():
        conn = psycopg.connect(**conninfo)
        conn.prepare_threshold = None
        return conn

    acks = []

    def fetch(conn, sql=COLD_FETCH):
        start = time.perf_counter()
        rows = conn.execute(sql).fetchall()
        took = (time.perf_counter() - start) * 1000
        if len(rows) != 100:
            raise SystemExit(f"a cold-relay fetch returned {len(rows)} rows: {sql}")
        start = time.perf_counter()
        acked = conn.execute("SELECT idempotency.idem_outbox_ack(%s::bigint[], %s::int[])",
                             ([r[0] for r in rows], [r[1] for r in rows])).fetchone()[0]
        acks.append((time.perf_counter() - start) * 1000)
        if acked != 100:
            raise SystemExit(f"a cold-relay ack took {acked} of 100 rows: {sql}")
        return took

    def steady_fetch(sql=COLD_FETCH):
        """the median of 50 calls on a connection that made 20 before"""
        with connect() as conn:
            for _ in range(20):
                fetch(conn, sql)
            return statistics.median(fetch(conn, sql) for _ in range(50))

    print(f"\n== cold relay: fetch of 100 on a backlog of {COLD_ROWS} rows, against the steady"
          " fetch; goal <= 2x", flush=True)
    cluster.psql("ALTER TABLE idempotency.outbox SET (autovacuum_enabled = off)")
    cluster.psql("TRUNCATE idempotency.outbox")
    fill_cold(cluster, COLD_ROWS)
    size = int(cluster.psql("SELECT pg_total_relation_size('idempotency.outbox')"))
    heap = int(cluster.psql("SELECT pg_table_size('idempotency.outbox')"))
    print(f"bytes per outbox row: {size / COLD_ROWS:.0f} (heap {heap / COLD_ROWS:.0f},"
          f" indexes {(size - heap) / COLD_ROWS:.0f}; {COLD_ROWS} rows of the pairs' payload)",
          flush=True)
    summary["outbox_bytes_per_row"] = round(size / COLD_ROWS)
    cluster.psql("VACUUM (ANALYZE) idempotency.outbox")
    cluster.psql("CHECKPOINT")
    steady = steady_fetch()
    steady_ack = statistics.median(acks[-50:])
    # each of ten new connections: its first five fetches
    fresh = []
    for _ in range(10):
        with connect() as conn:
            fresh.append([fetch(conn) for _ in range(5)])
    # the plain-SQL reference on the same table and backlog: one statement
    # that leases the topic's 100 oldest pending rows (pgmq's read, with
    # none of the fetch's per-key heads); its first call on a new
    # connection against its own steady call
    plain_steady = steady_fetch(PLAIN_FETCH)
    plain_first = []
    for _ in range(10):
        with connect() as conn:
            plain_first.append(fetch(conn, PLAIN_FETCH))
    # what a new backend's first call costs whatever the backlog (its
    # caches filled, the statements prepared): the first fetch of a topic
    # with no rows; and then the first of the backlog, whose plans (five
    # custom ones, left to plancache.c) are what remains of a cold start
    empty, after_empty = [], []
    for _ in range(10):
        with connect() as conn:
            start = time.perf_counter()
            conn.execute("SELECT * FROM idempotency.idem_outbox_fetch('cold-none', 100)").fetchall()
            empty.append((time.perf_counter() - start) * 1000)
            after_empty.append(fetch(conn))
    cluster.psql("TRUNCATE idempotency.outbox")
    cluster.psql(f"SELECT count(*) FROM idempotency.idem_outbox_enqueue_batch('cold',"
                 f" array_fill('{BENCH_PAYLOAD}'::jsonb, ARRAY[3]))")
    cluster.psql("ANALYZE idempotency.outbox")
    fill_cold(cluster, COLD_ROWS)
    cluster.psql("CHECKPOINT")
    stale = []
    for _ in range(5):
        with connect() as conn:
            stale.append([fetch(conn) for _ in range(5)])
    with connect() as conn:
        kept = [fetch(conn) for _ in range(30)][10:]
    # a connection whose acks were planned on a nearly empty outbox (ten
    # acks of two rows), then the backlog: its acks 11 to 30 (the plans it
    # keeps)
    cluster.psql("TRUNCATE idempotency.outbox")
    cluster.psql("VACUUM ANALYZE idempotency.outbox")
    with connect() as small:
        for _ in range(10):
            cluster.psql("SELECT count(*) FROM idempotency.idem_outbox_enqueue_batch('cold',"
                         f" array_fill('{BENCH_PAYLOAD}'::jsonb, ARRAY[2]))")
            rows = small.execute("SELECT id, attempts FROM idempotency.idem_outbox_fetch('cold', 2)").fetchall()
            small.execute("SELECT idempotency.idem_outbox_ack(%s::bigint[], %s::int[])",
                          ([r[0] for r in rows], [r[1] for r in rows]))
        fill_cold(cluster, COLD_ROWS)
        del acks[:]
        for _ in range(30):
            fetch(small)
        acks_kept_small = statistics.median(acks[10:])
    # a single call's time is at the mercy of the machine's other work:
    # the median over the new connections of each
    ratios = {"new connection, first fetch": statistics.median(f[0] for f in fresh) / steady,
              "new connection, first fetch after one of an empty topic":
                  statistics.median(after_empty) / steady,
              "new connection, slowest of its first five": statistics.median(max(f) for f in fresh) / steady,
              "stale statistics, first fetch": statistics.median(f[0] for f in stale) / steady,
              "stale statistics, slowest of the first five": statistics.median(max(f) for f in stale) / steady,
              "stale statistics, calls 11-30 of a connection": statistics.median(kept) / steady}
    print(f"steady fetch {steady:.2f} ms (median of 50); below, the median over 10 new connections"
          " (5 with stale statistics)", flush=True)
    for label, ratio in ratios.items():
        print(f"{label}: {ratio * steady:.2f} ms, {ratio:.2f}x ({'ok' if ratio <= 2 else 'MISS'})",
              flush=True)
    print(f"(a new connection's first fetch of an empty topic: {statistics.median(empty):.2f} ms:"
          " the backend's own start, whatever the backlog)", flush=True)
    print(f"(the ack of the 100 rows fetched: steady {steady_ack:.2f} ms; on a connection that"
          f" acknowledged its first rows on a nearly empty outbox, its acks 11-30 once the backlog"
          f" had come in: {acks_kept_small:.2f} ms, {acks_kept_small / steady_ack:.2f}x)", flush=True)
    summary["cold_ack_planned_small_vs_steady"] = round(acks_kept_small / steady_ack, 2)
    plain_ratio = statistics.median(plain_first) / plain_steady
    print(f"(the plain-SQL reference, one statement leasing the 100 oldest pending rows of the"
          f" same table: steady {plain_steady:.2f} ms, a new connection's first"
          f" {statistics.median(plain_first):.2f} ms, {plain_ratio:.2f}x)", flush=True)
    summary["cold_plain_fetch_vs_steady"] = round(plain_ratio, 2)
    summary["cold_fetch_vs_steady_max"] = round(max(ratios.values()), 2)
    cluster.psql("TRUNCATE idempotency.outbox")
    cluster.psql("ALTER TABLE idempotency.outbox RESET (autovacuum_enabled)")


ROUTE_ROWS = int(os.environ.get("BENCH_ROUTE_ROWS", "50000"))


def bench_default_route(cluster, summary):
    """The worker publishes a backlog of ROUTE_ROWS over three topics (the
    pairs' payload, to sink_it), with statistics taken while the outbox held
    as many rows published and kept (outbox_retention): once routed topic by
    topic, once by a default route ('*') alone.  Rows a second, from the
    route's setting to the backlog's last row in the sink; the default
    route's against the topics'.  Each round starts from the same table:
    the kept rows (published by an UPDATE, as the worker marks them), an
    ANALYZE, then the backlog, enqueued while no route took its topics."""
    spread = "ARRAY['spread1', 'spread2', 'spread3']"

    def fill():
        cluster.psql(f"SELECT count(*) FROM generate_series(0, {ROUTE_ROWS // 100 - 1}) b,"
                     f" LATERAL idempotency.idem_outbox_enqueue_batch(({spread})[b % 3 + 1],"
                     f" array_fill('{BENCH_PAYLOAD}'::jsonb, ARRAY[100]))")

    def drain(routes):
        cluster.psql("TRUNCATE idempotency.outbox, sink")
        fill()
        cluster.psql("UPDATE idempotency.outbox SET state = 'published', published_at = now()")
        cluster.psql("VACUUM (ANALYZE) idempotency.outbox")
        fill()
        start = time.perf_counter()
        cluster.psql(";".join(f"SELECT idempotency.idem_outbox_route('{topic}', 'function', 'sink_it')"
                              for topic in routes))
        while int(cluster.psql("SELECT count(*) FROM sink")) < ROUTE_ROWS:
            if time.perf_counter() - start > 600:
                raise SystemExit(f"the worker did not publish the backlog with routes {routes}")
            time.sleep(0.05)
        took = time.perf_counter() - start
        cluster.psql("DELETE FROM idempotency.outbox_routes WHERE topic LIKE 'spread%' OR topic = '*'")
        return ROUTE_ROWS / took

    print(f"\n== publishing a backlog of {ROUTE_ROWS} rows over three topics, statistics taken with"
          f" as many rows published and kept: a default route against a route per topic", flush=True)
    cluster.psql("ALTER TABLE idempotency.outbox SET (autovacuum_enabled = off)")
    cluster.psql("ALTER SYSTEM SET idempotency.outbox_retention = '1h'")
    cluster.psql("SELECT pg_reload_conf()")
    topics = drain(["spread1", "spread2", "spread3"])
    default = drain(["*"])
    ratio = default / topics
    print(f"a route per topic: {topics:.0f} rows/s; a default route: {default:.0f} rows/s;"
          f" default / per topic {ratio:.2f} (bar >= 0.80: {'ok' if ratio >= 0.8 else 'MISS'})",
          flush=True)
    summary["default_route_vs_topic_routes"] = round(ratio, 2)
    cluster.psql("ALTER SYSTEM RESET idempotency.outbox_retention")
    cluster.psql("SELECT pg_reload_conf()")
    cluster.psql("TRUNCATE idempotency.outbox, sink")
    cluster.psql("ALTER TABLE idempotency.outbox RESET (autovacuum_enabled)")


def fill_expired(cluster, table):
    cluster.psql(f"""
        INSERT INTO {table} (scope, key, attempt, status_code, body, ttl, created_at,
                             completed_at, expires_at)
        SELECT 'purge', n::text || '-' || clock_timestamp(), 1, 201, '{{"id": 1}}', '1 hour',
               now() - interval '1 day', now() - interval '1 day', now() - interval '1 hour'
        FROM generate_series(1, {PURGE_ROWS}) n""")


def purged(session):
    return int(session.query("SELECT purged FROM idempotency.idem_stats_counters()"))


def wait_pass_over(session, timeout=120):
    """Wait for the end of a pass of the worker's that began after now: a
    pass walks the rest of the table after the last rows, and vacuums a
    table it purged most of.  worker_last_round is when the last pass
    ended."""
    now = session.query("SELECT clock_timestamp()")
    deadline = time.time() + timeout
    while session.query("SELECT worker_last_round > '%s'"
                         " FROM idempotency.idem_stats_counters()" % now) != "t":
        if time.time() > deadline:
            raise SystemExit(f"no pass of the worker's ended within {timeout} s")
        time.sleep(0.05)


def set_purge_interval(cluster, interval):
    cluster.psql(f"ALTER SYSTEM SET idempotency.purge_interval = '{interval}'")
    cluster.psql("SELECT pg_reload_conf()")


BASELINE_SECONDS = 5


def purge_cycle(cluster, foreground=False):
    """Fill a million expired keys, then let the worker purge them (it holds
    off while they are written).  Returns the rate, the seconds the pass
    took, and the table's size once it is over, as (heap, indexes).  With
    foreground, 8 clients claim and complete new keys all along, from
    BASELINE_SECONDS before the purge to as long after its pass; the
    per-second tps reports are returned too, as (seconds since the purge
    began, tps, window) with window "quiet" or "purge" for the seconds
    measured."""
    set_purge_interval(cluster, "1h")
    fill_expired(cluster, "idempotency.keys")
    # as on a server where keys expire a day after they were written, every
    # page the purge changes is its first change since a checkpoint (and so
    # goes to the WAL whole); and no checkpoint the fill's WAL calls for
    # runs during the measurement
    cluster.psql("CHECKPOINT")
    claims = None
    if foreground:
        claims = cluster.pgbench_progress("claim_complete.sql")
        time.sleep(BASELINE_SECONDS + 1.5)
    session = cluster.session()
    before = purged(session)
    start = time.time()
    set_purge_interval(cluster, "100ms")
    while purged(session) - before < PURGE_ROWS:
        time.sleep(0.05)
    rate = PURGE_ROWS / (time.time() - start)
    wait_pass_over(session)
    end = time.time()
    reports = None
    if claims:
        # quiet again (past the pass that may have begun meanwhile)
        set_purge_interval(cluster, "1h")
        time.sleep(BASELINE_SECONDS + 2.5)
        reports = []
        # each report covers the second before its timestamp
        for at, tps in claims.stop():
            if start - BASELINE_SECONDS <= at - 1 and at <= start or \
                    end + 2 <= at - 1 and at <= end + 2 + BASELINE_SECONDS:
                window = "quiet"
            elif at > start and at - 1 < end:
                window = "purge"
            else:
                window = None
            reports.append((at - start, tps, window))
        # the vacuum the pass left for a quiet moment: in a pass that
        # begins once the claims have stopped
        set_purge_interval(cluster, "100ms")
        wait_pass_over(session)
        wait_pass_over(session)
    session.close()
    heap, indexes = (int(n) for n in cluster.psql(
        "SELECT pg_table_size('idempotency.keys'), pg_indexes_size('idempotency.keys')").split("|"))
    return rate, end - start, (heap, indexes), reports


# ---------------------------------------------------------------------------
# idem_claim's wait

class Waiters:
    """Connections that wait with idem_claim for a key when told to.  Each
    answer is kept with the server's clock just after idem_claim returned
    (clock_timestamp(), as epoch seconds).

    The claims are sent through libpq's asynchronous calls and their
    answers read once the holders are done: nothing of this process runs
    while they wait.  (A thread per waiter would sit in psycopg's wait
    loop, which wakes ten times a second: 10,000 wake-ups a second for
    1,000 waiters, on the cores the server runs on.)"""

    CLAIM = (b"SELECT outcome, extract(epoch FROM clock_timestamp())::float8"
             b" FROM idempotency.idem_claim('wait', $1, wait => $2::interval)")

    def __init__(self, cluster, count):
        import psycopg
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < count + 100:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 200), hard))
        self.conninfo = dict(host=cluster.dir, port=cluster.port, user="postgres",
                             dbname="postgres", autocommit=True)
        self.conns = [psycopg.connect(**self.conninfo) for _ in range(count)]
        self.sent = []

    def start(self, keys, wait="10 min"):
        """Waiter i sends its claim of keys[i], with the wait."""
        self.sent = self.conns[:len(keys)]
        for conn, key in zip(self.sent, keys):
            conn.pgconn.send_query_params(self.CLAIM, [key.encode(), wait.encode()])
            while conn.pgconn.flush():
                select.select([], [conn.pgconn.socket], [])

    def join(self):
        """Each waiter's (outcome, answered at), in the order of start's keys."""
        from psycopg import pq
        answers = []
        for conn in self.sent:
            pgconn = conn.pgconn
            last = None
            while True:
                while pgconn.is_busy():
                    select.select([pgconn.socket], [], [])
                    pgconn.consume_input()
                result = pgconn.get_result()
                if result is None:
                    break
                last = result
            if last is None or last.status != pq.ExecStatus.TUPLES_OK:
                message = last.error_message.decode() if last is not None else "no result"
                raise SystemExit(f"a waiter's idem_claim failed: {message}")
            answers.append((last.get_value(0, 0).decode(), float(last.get_value(0, 1))))
        self.sent = []
        return answers

    def close(self):
        for conn in self.conns:
            conn.close()


# what a waiting claim shows in pg_stat_activity: the C edition's sleep in
# its wait slot; the SQL edition's wait for the holder's lock
PARKED_C = "wait_event_type = 'Extension' AND wait_event IN ('IdempotencyClaimWait', 'Extension')"
PARKED_SQL_LOCK = "wait_event_type = 'Lock' AND wait_event = 'advisory'"


def parked(session, count, timeout=120, condition=PARKED_C):
    """Until count sessions wait in idem_claim's wait (condition)."""
    deadline = time.time() + timeout
    while session.query("SELECT count(*) FROM pg_stat_activity"
                        f" WHERE backend_type = 'client backend' AND {condition}") != str(count):
        if time.time() > deadline:
            raise SystemExit(f"{count} waiters did not all park within {timeout} s")
        time.sleep(0.05)


def latencies(answers, commit_at):
    """Each waiter's answer after its holder's commit, in ms: median, p99."""
    ms = sorted((at - commit_at[i]) * 1000 for i, (_, at) in enumerate(answers))
    return statistics.median(ms), ms[min(len(ms) - 1, int(len(ms) * 0.99))]


def bench_wait():
    """A holder's commit and its waiters' answers, measured on the server's
    clock: from clock_timestamp() in the holder's last statement before its
    COMMIT (sent in the same message, with synchronous_commit off so that
    the commit is visible once its record is written, not after a WAL
    flush) to clock_timestamp() in each waiter's statement just after
    idem_claim returned.  Then 8 clients claim + complete with 1,000 waiters
    parked, against the same with the waiters' connections idle."""
    import psycopg
    results = {}
    cluster = Cluster(extra_conf=f"max_connections = {WAITERS + 100}\n", port_offset=1)
    try:
        cluster.psql_file(os.path.join(HERE, "setup.sql"))
        cluster.psql("CREATE TABLE bench_wait_commit (key text, at float8)")
        session = cluster.session()
        holder = psycopg.connect(host=cluster.dir, port=cluster.port, user="postgres",
                                 dbname="postgres", autocommit=True)
        waiters = Waiters(cluster, WAITERS)

        def commit_sql(key, completion):
            return ("BEGIN; SET LOCAL synchronous_commit = off; " + completion +
                    f"; INSERT INTO bench_wait_commit VALUES ('{key}',"
                    " extract(epoch FROM clock_timestamp())); COMMIT")

        # warm-up, untimed: each waiter waits once and replays, which loads
        # what its backend caches and touches the memory it uses (as a
        # pooled connection's backend has done), not what is measured below
        holder.execute("BEGIN; SELECT idempotency.idem_claim('wait', 'warm-up')")
        waiters.start(["warm-up"] * WAITERS)
        parked(session, WAITERS)
        holder.execute("SELECT idempotency.idem_complete('wait', 'warm-up', 201, 'done'); COMMIT")
        assert all(outcome == "replay" for outcome, _ in waiters.join())

        # 100 waiters on one key, held by a claim not yet committed
        one = {}
        for round_no in range(3):
            key = f"one-{round_no}"
            holder.execute(f"BEGIN; SELECT idempotency.idem_claim('wait', '{key}')")
            waiters.start([key] * 100)
            parked(session, 100)
            holder.execute(commit_sql(key, f"SELECT idempotency.idem_complete('wait', '{key}', 201, 'done')"))
            answers = waiters.join()
            at = float(cluster.psql(f"SELECT at FROM bench_wait_commit WHERE key = '{key}'"))
            assert all(outcome == "replay" for outcome, _ in answers), answers
            one.setdefault("p50", []).append(latencies(answers, [at] * 100)[0])
            one.setdefault("p99", []).append(latencies(answers, [at] * 100)[1])
        print(f"100 waiters, one key: answer after the holder's commit, median "
              f"{statistics.median(one['p50']):.2f} ms, p99 {statistics.median(one['p99']):.2f} ms"
              f" (median of 3 rounds; each round's p99: "
              f"{' '.join(f'{x:.1f}' for x in one['p99'])})", flush=True)
        results["wait_one_key_p50_ms"] = round(statistics.median(one["p50"]), 2)
        results["wait_one_key_p99_ms"] = round(statistics.median(one["p99"]), 2)

        # WAITERS waiters on as many keys, each held by a committed claim;
        # the holder completes them one transaction after another
        keys = [f"many-{i}" for i in range(WAITERS)]
        cluster.psql("SELECT idempotency.idem_claim('wait', 'many-' || n, lease => '1 hour')"
                     f" FROM generate_series(0, {WAITERS - 1}) n")
        waiters.start(keys)
        parked(session, WAITERS)
        for key in keys:
            holder.execute(commit_sql(key, f"SELECT idempotency.idem_complete('wait', '{key}', 201, 'done', NULL, 1)"))
        answers = waiters.join()
        assert all(outcome == "replay" for outcome, _ in answers), answers
        commit_at = dict(line.split("|") for line in cluster.psql(
            "SELECT key, at FROM bench_wait_commit WHERE key LIKE 'many-%'").splitlines())
        p50, p99 = latencies(answers, [float(commit_at[key]) for key in keys])
        print(f"{WAITERS} waiters, {WAITERS} keys, their holders committing one after another:"
              f" median {p50:.2f} ms, p99 {p99:.2f} ms", flush=True)
        results["wait_many_keys_p50_ms"] = round(p50, 2)
        results["wait_many_keys_p99_ms"] = round(p99, 2)

        # claim + complete, WAITERS waiters parked (on keys of their own,
        # held by committed claims) or their connections idle, alternating
        tps = {"parked": [], "idle": []}
        for round_no in range(ROUNDS):
            order = ["parked", "idle"] if round_no % 2 == 0 else ["idle", "parked"]
            for side in order:
                cluster.psql("VACUUM (ANALYZE) idempotency.keys")
                cluster.psql("CHECKPOINT")
                if side == "parked":
                    keys = [f"parked-{round_no}-{i}" for i in range(WAITERS)]
                    cluster.psql(f"SELECT idempotency.idem_claim('wait', 'parked-{round_no}-' || n,"
                                 f" lease => '1 hour') FROM generate_series(0, {WAITERS - 1}) n")
                    waiters.start(keys)
                    parked(session, WAITERS)
                tps[side].append(cluster.pgbench("claim_complete.sql", SECONDS)[0])
                if side == "parked":
                    cluster.psql(f"SELECT idempotency.idem_complete('wait', 'parked-{round_no}-' || n,"
                                 f" 201, 'done', NULL, 1) FROM generate_series(0, {WAITERS - 1}) n")
                    waiters.join()
        ratios = [p / i for p, i in zip(tps["parked"], tps["idle"])]
        ratio = statistics.median(ratios)
        print(f"claim + complete, 8 clients, {WAITERS} waiters parked: "
              f"{statistics.median(tps['parked']):.0f} tps, without: {statistics.median(tps['idle']):.0f} tps,"
              f" ratio {ratio:.2f} (bar 0.90: {'ok' if ratio >= 0.9 else 'MISS'}); each round:"
              f" {' '.join(f'{r:.2f}' for r in ratios)}", flush=True)
        results["wait_parked_vs_none"] = round(ratio, 3)
        waiters.close()
        holder.close()
        session.close()
    finally:
        cluster.stop()
    return results


REPLAY_ROWS = """
INSERT INTO idempotency.keys (scope, key, fingerprint, attempt, status_code, body, headers,
                              ttl, created_at, completed_at, expires_at)
SELECT 'replay', n::text, NULL, 1, 201, '{"id": ' || n || ', "status": "created"}',
       '{"Location": "/payments/1"}', '24 hours', now(), now(), now() + interval '24 hours'
FROM generate_series(1, 100000) n"""


def bench_wake(cluster, edition, waiters=100, rounds=3):
    """How soon a waiter answers once its holder commits (as bench_wait
    measures it), for one edition's cluster: waiters on one key that a
    claim in flight holds, and as many on keys of their own held by
    committed claims whose leases run (the SQL edition looks at those again
    every 10 ms).  Returns {case: (median p50, median p99)} in ms."""
    import psycopg
    session = cluster.session()
    holder = psycopg.connect(host=cluster.dir, port=cluster.port, user="postgres",
                             dbname="postgres", autocommit=True)
    pool = Waiters(cluster, waiters)
    cluster.psql("CREATE TABLE IF NOT EXISTS bench_wait_commit (key text, at float8)")

    def commit(key, completion):
        holder.execute("BEGIN; SET LOCAL synchronous_commit = off; " + completion +
                       f"; INSERT INTO bench_wait_commit VALUES ('{key}',"
                       " extract(epoch FROM clock_timestamp())); COMMIT")

    def active_claims(count):
        # a waiter that polls a committed claim's lease is active throughout
        parked(session, count, condition="state = 'active' AND query LIKE '%idem_claim(''wait''%'")

    results = {}
    try:
        for case in ("in flight", "committed"):
            p50s, p99s = [], []
            for round_no in range(rounds):
                tag = f"{edition}-{'f' if case == 'in flight' else 'c'}-{round_no}"
                if case == "in flight":
                    keys = [tag] * waiters
                    holder.execute(f"BEGIN; SELECT idempotency.idem_claim('wait', '{tag}')")
                    pool.start(keys)
                    parked(session, waiters, condition=PARKED_C if edition == "c" else PARKED_SQL_LOCK)
                    commit(tag, f"SELECT idempotency.idem_complete('wait', '{tag}', 201, 'done')")
                    at = [float(cluster.psql(f"SELECT at FROM bench_wait_commit WHERE key = '{tag}'"))] * waiters
                else:
                    keys = [f"{tag}-{i}" for i in range(waiters)]
                    cluster.psql(f"SELECT idempotency.idem_claim('wait', '{tag}-' || n, lease => '1 hour')"
                                 f" FROM generate_series(0, {waiters - 1}) n")
                    pool.start(keys)
                    if edition == "c":
                        parked(session, waiters)
                    else:
                        active_claims(waiters)
                    for key in keys:
                        commit(key, f"SELECT idempotency.idem_complete('wait', '{key}', 201, 'done', NULL, 1)")
                    commit_at = dict(line.split("|") for line in cluster.psql(
                        f"SELECT key, at FROM bench_wait_commit WHERE key LIKE '{tag}-%'").splitlines())
                    at = [float(commit_at[key]) for key in keys]
                answers = pool.join()
                assert all(outcome == "replay" for outcome, _ in answers), answers
                p50, p99 = latencies(answers, at)
                p50s.append(p50)
                p99s.append(p99)
            results[case] = (statistics.median(p50s), statistics.median(p99s))
    finally:
        pool.close()
        holder.close()
        session.close()
    return results


def bench_edition(summary):
    """The SQL edition against the C edition, in the same run: two fresh
    clusters from the same binaries and settings, one preloading the library
    (CREATE EXTENSION), the other without it, where a role that only holds
    CREATE on the database ran make dist's script; each with the same
    100,000 stored responses.  Each line's rounds alternate which edition
    goes first; the ratio is the median of the rounds' SQL / C."""
    if not SQL_EDITION_SCRIPT:
        raise SystemExit("EDITION=sql needs BENCH_SQL_EDITION: make bench builds the script")
    c_cluster = Cluster(port_offset=1, extra_conf="max_connections = 200\n")
    sql_cluster = Cluster(port_offset=2, preload=False, extra_conf="max_connections = 200\n")
    try:
        c_cluster.psql("CREATE EXTENSION idempotency")
        sql_cluster.psql("CREATE ROLE idem_owner LOGIN; "
                         "GRANT CREATE ON DATABASE postgres TO idem_owner")
        sql_cluster.run([f"{PGBIN}/psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", sql_cluster.dir,
                         "-p", str(sql_cluster.port), "-U", "idem_owner", "-d", "postgres",
                         "-f", SQL_EDITION_SCRIPT])
        for cluster in (c_cluster, sql_cluster):
            cluster.psql(REPLAY_ROWS)
        print(f"\n== the SQL edition against the C edition ({CLIENTS} clients, {SECONDS} s,"
              f" {ROUNDS} rounds alternating)")
        header = f"{'workload':28} {'SQL tps':>10} {'lat ms':>7} {'C tps':>10} {'lat ms':>7} {'SQL/C':>6}"
        print(header)
        print("-" * len(header))
        for name, script in [line for line in EDITION_LINES if line[0] in EDITION_WANTED]:
            results = {"sql": [], "c": []}
            for round_no in range(ROUNDS):
                order = [("sql", sql_cluster), ("c", c_cluster)]
                if round_no % 2:
                    order.reverse()
                for side, cluster in order:
                    cluster.psql("VACUUM (ANALYZE) idempotency.keys, idempotency.processed_events")
                    cluster.psql("CHECKPOINT")
                    results[side].append(cluster.pgbench(script, SECONDS))
            ratios = [sql_tps / c_tps for (sql_tps, _), (c_tps, _) in zip(results["sql"], results["c"])]
            ratio = statistics.median(ratios)
            median = {side: (statistics.median(t for t, _ in runs), statistics.median(l for _, l in runs))
                      for side, runs in results.items()}
            print(f"{name:28} {median['sql'][0]:10.0f} {median['sql'][1]:7.2f} "
                  f"{median['c'][0]:10.0f} {median['c'][1]:7.2f} {ratio:6.2f}", flush=True)
            print(f"   ratio in each round: {' '.join(f'{r:.2f}' for r in ratios)}; load {load()}",
                  flush=True)
            summary[f"sql_edition_{name}"] = round(ratio, 3)
        if "drain" in EDITION_WANTED:
            # one relay drains DRAIN_ROWS ready rows of 1,000 keys, fetch
            # then ack in batches of 100, as bench_drain's "ours"
            results = {"sql": [], "c": []}
            for round_no in range(ROUNDS):
                order = [("sql", sql_cluster), ("c", c_cluster)]
                if round_no % 2:
                    order.reverse()
                for side, cluster in order:
                    cluster.psql("TRUNCATE idempotency.outbox; "
                                 "SELECT count(*) FROM idempotency.idem_outbox_enqueue_batch('drain', "
                                 f"array_fill('{{\"order_id\": 123456, \"status\": \"created\"}}'::jsonb, ARRAY[{DRAIN_ROWS}]), "
                                 f"(SELECT array_agg('k' || n % 1000) FROM generate_series(1, {DRAIN_ROWS}) n))")
                    cluster.psql("VACUUM (ANALYZE) idempotency.outbox")
                    cluster.psql("CHECKPOINT")
                    results[side].append(drain_once(cluster, "drain.sql", DRAIN_ROWS // 100))
                    left = int(cluster.psql("SELECT count(*) FROM idempotency.outbox"))
                    if left:
                        raise SystemExit(f"the {side} edition's drain left {left} rows")
            ratios = [s_ / c_ for s_, c_ in zip(results["sql"], results["c"])]
            print(f"{'drain (batches/s)':28} {statistics.median(results['sql']):10.0f} {'':7} "
                  f"{statistics.median(results['c']):10.0f} {'':7} {statistics.median(ratios):6.2f}")
            print(f"   ratio in each round: {' '.join(f'{r:.2f}' for r in ratios)}; load {load()}",
                  flush=True)
            summary["sql_edition_drain"] = round(statistics.median(ratios), 3)
        # a waiter's answer after its holder's commit, in each edition
        wake = {edition: bench_wake(cluster, edition) for edition, cluster in
                (("sql", sql_cluster), ("c", c_cluster))}
        for case in ("in flight", "committed"):
            print(f"wake, 100 waiters, holder {case:9}: SQL median {wake['sql'][case][0]:.2f} ms,"
                  f" p99 {wake['sql'][case][1]:.2f} ms; C median {wake['c'][case][0]:.2f} ms,"
                  f" p99 {wake['c'][case][1]:.2f} ms", flush=True)
            name = "in_flight" if case == "in flight" else "committed"
            summary[f"sql_edition_wake_{name}_p50_ms"] = round(wake["sql"][case][0], 2)
            summary[f"c_edition_wake_{name}_p50_ms"] = round(wake["c"][case][0], 2)
    finally:
        c_cluster.stop()
        sql_cluster.stop()


def mb(size):
    """A (heap, indexes) size as the cycle lines print it."""
    return f"{sum(size) / 2**20:.0f} MB (heap {size[0] / 2**20:.0f} + indexes {size[1] / 2**20:.0f})"


def main():
    cluster = Cluster()
    try:
        version = cluster.psql("SHOW server_version")
        print(f"== idempotency benchmark: PostgreSQL {version}, {machine()}; load {load()}")
        print(f"   pgbench -M prepared, {CLIENTS} clients (mark_batch_vs_single: 1), {SECONDS} s,"
              f" {ROUNDS} rounds alternating;"
              " tps: median of rounds; ratio: median of the rounds' ratios")
        cluster.psql_file(os.path.join(HERE, "setup.sql"))
        cluster.psql_file(os.path.join(HERE, "peers", "plpgsql.sql"))

        summary = {}
        if "pairs" not in PARTS:
            PAIRS.clear()
        if os.environ.get("BENCH_PAIRS"):
            wanted = os.environ["BENCH_PAIRS"].split(",")
            PAIRS[:] = [pair for pair in PAIRS if pair[0] in wanted]
        pair_tables_autovacuum(cluster, False)
        header = f"{'workload':28} {'ours tps':>10} {'lat ms':>7} {'ref tps':>10} {'lat ms':>7} {'ratio':>6} {'bar':>5}"
        print(header)
        print("-" * len(header))
        for name, ours, ref, bar, *options in PAIRS:
            if ours == "claim_complete.sql":
                # each claim pair starts from the same 100,000 stored
                # responses on both sides, rather than ours from what the
                # pair before left.  Not from empty tables: the VACUUM
                # (ANALYZE) before a run would record them as empty, and the
                # PL/pgSQL peer's functions would cache sequential scans for
                # the whole of their first run (half its speed).
                cluster.psql("TRUNCATE idempotency.keys, bench_floor, peer_keys; "
                             "INSERT INTO idempotency.keys SELECT * FROM bench_replay; "
                             "INSERT INTO bench_floor SELECT * FROM bench_replay; "
                             "INSERT INTO peer_keys SELECT * FROM bench_replay")
            if ours == "mark_processed_batch.sql":
                # millions of rows a pair: each starts from empty tables
                cluster.psql("TRUNCATE idempotency.processed_events, bench_events")
            median, ratio = compare(cluster, ours, ref, **(options[0] if options else {}))
            summary[name] = round(ratio, 3)
            verdict = "-" if bar is None else "ok" if ratio >= bar else "MISS"
            print(f"{name:28} {median['ours'][0]:10.0f} {median['ours'][1]:7.2f} "
                  f"{median['ref'][0]:10.0f} {median['ref'][1]:7.2f} {ratio:6.2f} "
                  f"{verdict:>5}", flush=True)
            print(f"   ratio in each round: {median['rounds']}; CPU time stolen by the host,"
                  f" % (ours/ref): {median['steal']}; load {load()}", flush=True)

        if "shapes" in PARTS:
            print("\n== claim + complete vs floor, other shapes (one round, 10 s, no bar)")
        for label, kwargs in [] if "shapes" not in PARTS else [("1 client", {"clients": 1}), ("32 clients", {"clients": 32}),
                              ("8 clients, synchronous_commit off",
                               {"options": "-c synchronous_commit=off"})]:
            cluster.psql("TRUNCATE idempotency.keys, bench_floor")
            median, ratio = compare(cluster, "claim_complete.sql", "floor.sql", seconds=10,
                                    rounds=1, **kwargs)
            print(f"{label:36} ours {median['ours'][0]:8.0f} tps  floor {median['ref'][0]:8.0f} tps"
                  f"  ratio {ratio:.2f}", flush=True)

        # the batch against its 500 single calls between one consumer (the
        # pair's bar) and 8 clients (the pair without a bar)
        if "shapes" in PARTS:
            print("\n== idem_mark_processed_batch of 500 vs 500 single calls, other shapes"
                  " (one round, 10 s, no bar)")
        for label, clients in [] if "shapes" not in PARTS else [("2 clients", 2)]:
            cluster.psql("TRUNCATE idempotency.processed_events")
            median, ratio = compare(cluster, "mark_processed_batch.sql", "mark_processed_500.sql",
                                    seconds=10, rounds=1, clients=clients)
            print(f"{label:36} batch {median['ours'][0]:7.0f} tps  single {median['ref'][0]:7.0f} tps"
                  f"  ratio {ratio:.2f}", flush=True)

        pair_tables_autovacuum(cluster, True)
        if EDITION == "sql":
            bench_edition(summary)
        if "outbox" in PARTS:
            bench_outbox(cluster, summary)
        if "endtoend" in PARTS:
            bench_end_to_end(cluster, summary)
        if "cold" in PARTS:
            bench_cold_relay(cluster, summary)
        if "publish" in PARTS:
            print(f"\n== publishing: function route, 8 clients enqueue for {PUBLISH_SECONDS} s")
            published = bench_publish(cluster)
            print(f"enqueue {published['tps']:.0f} tps; backlog max {published['backlog_max']}, "
                  f"last {published['backlog_last']}, after 2 s {published['drained']}; "
                  f"commit->publish p50 {published['p50']:.1f} ms, p99 {published['p99']:.1f} ms; "
                  f"keeps up: {published['keeps_up']}; failed publishing attempts: {published['failures']}; "
                  f"entries of outbox_ready the worker read per row published: {published['ready_read_per_row']:.1f}",
                  flush=True)
            summary["publish_keeps_up"] = published["keeps_up"]
            summary["publish_p50_ms"] = round(published["p50"], 2)
            summary["publish_p99_ms"] = round(published["p99"], 2)
            summary["publish_ready_read_per_row"] = round(published["ready_read_per_row"], 1)

        if "routes" in PARTS:
            bench_default_route(cluster, summary)

        if "wait" in PARTS:
            print(f"\n== idem_claim's wait: a cluster of its own, max_connections {WAITERS + 100}")
            summary.update(bench_wait())

        if "purge" not in PARTS:
            print(json.dumps(summary))
            return
        print(f"\n== purge: {PURGE_ROWS} expired keys, three fill/purge cycles")
        while int(cluster.psql("SELECT count(*) FROM idempotency.outbox WHERE topic = 'published'")):
            time.sleep(1)    # the publishing backlog, if any, goes first
        cluster.psql("TRUNCATE idempotency.keys")
        fill_expired(cluster, "bench_purge")
        start = time.time()
        cluster.psql("CALL plain_batched_delete(5000)")
        plain_rate = PURGE_ROWS / (time.time() - start)
        rate, took, size1, _ = purge_cycle(cluster)
        print(f"cycle 1: {rate:,.0f} rows/s (pass over in {took:.1f} s); plain batched DELETE "
              f"{plain_rate:,.0f} rows/s; size {mb(size1)}", flush=True)
        rate2, took2, size2, reports = purge_cycle(cluster, foreground=True)
        quiet = statistics.median(tps for _, tps, window in reports if window == "quiet")
        during = statistics.median(tps for _, tps, window in reports if window == "purge")
        print(f"cycle 2, 8 clients claiming: {rate2:,.0f} rows/s (pass over in {took2:.1f} s); "
              f"claim+complete {during:.0f} tps during the pass, {quiet:.0f} tps in the "
              f"{BASELINE_SECONDS} s before and after (medians of per-second rates); "
              f"size {mb(size2)}", flush=True)
        print("   tps each second (q: quiet, p: purging): " +
              " ".join(f"{at:+.0f}{(window or ' ')[0]}{tps:.0f}" for at, tps, window in reports),
              flush=True)
        rate3, took3, size3, _ = purge_cycle(cluster)
        # the keys cycle 2's clients claimed are live (24 h): cycle 3's
        # million expired ones need room beside them
        live = int(cluster.psql("SELECT count(*) FROM idempotency.keys"))
        print(f"cycle 3: {rate3:,.0f} rows/s (pass over in {took3:.1f} s); size {mb(size3)} "
              f"({sum(size3) / sum(size1):.2f}x cycle 1), holding the {live:,} live keys cycle 2's "
              f"clients claimed", flush=True)
        summary["purge_rows_per_s"] = round(statistics.median([rate, rate2, rate3]))
        summary["foreground_during_purge"] = round(during / quiet, 3)
        summary["bloat_after_3_cycles"] = round(sum(size3) / sum(size1), 3)
    finally:
        problems, lines = cluster.log_problems()
        if problems:
            print(f"\n== the server log has {problems} ERROR/WARNING/FATAL/PANIC lines; the last:")
            print("\n".join(lines))
        cluster.stop()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
