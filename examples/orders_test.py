"""The HTTP tests of the Python example apps (fastapi, django, flask).

Each examples/<framework>/test.sh runs this module with pytest, with
EXAMPLE_DIR set to its folder: the app is started by its own ``serve``
script on a free port of 127.0.0.1, with IDEM_TEST_HOOKS=1, against the
database of libpq's environment variables, and driven over real HTTP
connections. What is checked is doc/http.md's protocol.
"""
import concurrent.futures
import http.client
import json
import os
import socket
import subprocess
import time
import uuid

import psycopg
import pytest

EXAMPLE_DIR = os.environ["EXAMPLE_DIR"]
TMP = os.environ.get("EXAMPLE_TMP", "/tmp")
ALLOW_LISTED = ("content-type", "content-location", "location", "etag", "last-modified",
                "cache-control", "vary")


class App:
    """The example app's process, started by its serve script."""

    def __init__(self) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.log = open(os.path.join(TMP, "serve.log"), "ab")
        self.process: "subprocess.Popen[bytes] | None" = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [os.path.join(EXAMPLE_DIR, "serve"), str(self.port)],
            env={**os.environ, "IDEM_TEST_HOOKS": "1"}, stdout=self.log, stderr=self.log,
            start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"serve exited: see {self.log.name}"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"serve did not listen on {self.port}: see {self.log.name}")

    def ensure_running(self) -> None:
        """A single-process server killed by X-Crash is started again."""
        if self.process is None or self.process.poll() is not None:
            self.start()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def app():
    app = App()
    app.start()
    yield app
    app.stop()


@pytest.fixture(scope="module")
def db():
    # prepare_threshold=None: pgbouncer in transaction pooling mode
    with psycopg.connect("", autocommit=True, prepare_threshold=None) as conn:
        yield conn


class Reply:
    def __init__(self, status: int, headers: "list[tuple[str, str]]", body: bytes) -> None:
        self.status, self.body = status, body
        self.headers = {name.lower(): value for name, value in headers}

    def json(self):
        return json.loads(self.body)

    @property
    def replayed(self) -> bool:
        return self.headers.get("idempotent-replayed") == "true"


def post(app: App, body, key=None, timeout=30, **headers) -> Reply:
    """POST /orders; a key of None sends no Idempotency-Key header."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent = {"Content-Type": "application/json", "Connection": "close"}
    if key is not None:
        sent["Idempotency-Key"] = key
    sent.update({name.replace("_", "-"): str(value) for name, value in headers.items()})
    conn = http.client.HTTPConnection("127.0.0.1", app.port, timeout=timeout)
    try:
        conn.request("POST", "/orders", raw, sent)
        response = conn.getresponse()
        return Reply(response.status, response.getheaders(), response.read())
    finally:
        conn.close()


def order(qty=1):
    return {"sku": f"sku-{uuid.uuid4()}", "qty": qty}


def rows(db, sku) -> int:
    return db.execute("SELECT count(*) FROM orders WHERE sku = %s", (sku,)).fetchone()[0]


def assert_problem(reply: Reply, status: int) -> None:
    assert reply.status == status, reply.body
    assert reply.headers["content-type"] == "application/problem+json"
    problem = reply.json()
    assert problem["status"] == status and problem["type"] == "about:blank"
    assert problem["title"] and problem["detail"]


def wait_for_sleeping_handler(db) -> None:
    """Until a handler sits in X-Delay-Ms's pg_sleep: it holds its key."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if db.execute("""SELECT count(*) FROM pg_stat_activity
                         WHERE datname = current_database() AND state = 'active'
                           AND query ~ '^SELECT pg_sleep'""").fetchone()[0]:
            return
        time.sleep(0.02)
    raise AssertionError("no handler reached its X-Delay-Ms sleep")


def test_new_key_then_byte_exact_replay(app, db):
    body, key = order(), str(uuid.uuid4())
    first = post(app, body, key)
    assert first.status == 201 and not first.replayed
    assert first.json()["sku"] == body["sku"] and first.json()["qty"] == body["qty"]
    again = post(app, body, key)
    assert again.status == 201 and again.replayed
    assert again.body == first.body
    for name in ALLOW_LISTED:
        assert again.headers.get(name) == first.headers.get(name), name
    assert first.headers["location"] == f"/orders/{first.json()['id']}"
    assert rows(db, body["sku"]) == 1


def test_twenty_concurrent_requests_one_row(app, db):
    body, key = order(), str(uuid.uuid4())
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        replies = list(pool.map(lambda _: post(app, body, key, X_Delay_Ms=300), range(20)))
    ran = [r for r in replies if r.status == 201 and not r.replayed]
    assert len(ran) == 1, [(r.status, r.body) for r in replies]
    for reply in replies:
        if reply.status == 409:
            assert_problem(reply, 409)
            assert int(reply.headers["retry-after"]) >= 1
        elif reply is not ran[0]:
            assert reply.status == 201 and reply.replayed and reply.body == ran[0].body
    assert rows(db, body["sku"]) == 1


def test_in_flight_past_the_wait_is_409_with_retry_after(app, db):
    body, key = order(), str(uuid.uuid4())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # longer than the middleware's wait (2 s) after the duplicate starts
        holder = pool.submit(post, app, body, key, X_Delay_Ms=6000)
        wait_for_sleeping_handler(db)
        duplicate = post(app, body, key)
        assert_problem(duplicate, 409)
        assert duplicate.headers["retry-after"] == "1"  # the holder's transaction is open
        assert holder.result().status == 201
    assert rows(db, body["sku"]) == 1


def test_changed_body_is_422(app, db):
    body, key = order(), str(uuid.uuid4())
    assert post(app, body, key).status == 201
    assert_problem(post(app, {**body, "qty": 2}, key), 422)
    assert rows(db, body["sku"]) == 1


def test_missing_empty_and_over_long_keys_are_400(app, db):
    body = order()
    assert_problem(post(app, body), 400)
    assert_problem(post(app, body, ""), 400)
    assert_problem(post(app, body, "k" * 256), 400)
    assert rows(db, body["sku"]) == 0
    longest = (str(uuid.uuid4()) * 8)[:255]
    assert post(app, body, longest).status == 201


def test_quoted_key_is_the_same_key(app, db):
    body, key = order(), str(uuid.uuid4())
    first = post(app, body, key)
    again = post(app, body, f'"{key}"')
    assert again.replayed and again.body == first.body


def test_503_is_not_stored_and_the_retry_runs(app, db):
    body, key = order(), str(uuid.uuid4())
    failed = post(app, body, key, X_Fail_Status=503)
    assert failed.status == 503 and not failed.replayed
    retry = post(app, body, key)
    assert retry.status == 201 and not retry.replayed
    assert rows(db, body["sku"]) == 1


def test_404_is_stored_and_replayed(app, db):
    body, key = order(), str(uuid.uuid4())
    first = post(app, body, key, X_Fail_Status=404)
    again = post(app, body, key)
    assert first.status == again.status == 404
    assert again.replayed and again.body == first.body
    assert rows(db, body["sku"]) == 0


def test_crash_mid_handler_then_retry_makes_one_row(app, db):
    body, key = order(), str(uuid.uuid4())
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        post(app, body, key, X_Crash=1)
    # the retry: once the server is back (gunicorn's master starts a new
    # worker; a single uvicorn is started again here), and once the dead
    # request's transaction has ended (409 until then)
    deadline = time.monotonic() + 60
    while True:
        app.ensure_running()
        try:
            retry = post(app, body, key)
        except (http.client.HTTPException, ConnectionError):
            retry = None
        if retry is not None and retry.status != 409:
            break
        assert time.monotonic() < deadline, "the retry never ran"
        time.sleep(0.1)
    assert retry.status == 201 and not retry.replayed
    assert rows(db, body["sku"]) == 1


def test_two_principals_run_twice(app, db):
    body, key = order(), str(uuid.uuid4())
    alice = post(app, body, key, Authorization="Bearer alice")
    bob = post(app, body, key, Authorization="Bearer bob")
    assert alice.status == bob.status == 201
    assert not alice.replayed and not bob.replayed
    assert alice.json()["id"] != bob.json()["id"]
    assert rows(db, body["sku"]) == 2
    again = post(app, body, key, Authorization="Bearer alice")
    assert again.replayed and again.body == alice.body
