"""doc/http.md's protocol, the same tests for each adapter (apps.py)."""
import base64
import concurrent.futures
import contextlib
import hashlib
import http.client
import json
import socket
import threading
import uuid

import pytest
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from apps import (BACKGROUND_GATE, BACKGROUND_SAW, BINARY, GATE, django_app, flask_app,
                  starlette_app)
from conftest import POOL_KWARGS, post, serve_asgi, serve_wsgi


@pytest.fixture(scope="module", params=["asgi", "flask", "django"])
def server(request, db):
    if request.param == "asgi":
        pool = AsyncConnectionPool("", open=False, min_size=4, kwargs=POOL_KWARGS)
        with serve_asgi(starlette_app(pool)) as port:
            yield port
    elif request.param == "flask":
        with ConnectionPool("", open=True, min_size=4, kwargs=POOL_KWARGS) as pool:
            with serve_wsgi(flask_app(pool)) as port:
                yield port
    else:
        with serve_wsgi(django_app()) as port:
            yield port


def order():
    return {"sku": f"sku-{uuid.uuid4()}", "qty": 1}


def rows(db, sku):
    return db.execute("SELECT count(*) FROM orders WHERE sku = %s", (sku,)).fetchone()[0]


def stored(db, key):
    return db.execute("""SELECT scope, attempt, recovery_point, lease_expires_at, body,
                                headers->>':idem-body-encoding'
                         FROM idempotency.keys WHERE key = %s""", (key,)).fetchall()


def wait_for_checkpoint(db, key, point):
    """Until the handler's checkpoint has committed (the database's word)."""
    for _ in range(3000):
        found = stored(db, key)
        if found and found[0][2] == point:
            return found[0]
        db.execute("SELECT pg_sleep(0.01)")
    raise AssertionError(f"no checkpoint {point!r} for {key}")


def test_binary_body_is_stored_in_base64_and_replayed_byte_for_byte(server, db):
    key = str(uuid.uuid4())
    first = post(server, "/binary", key=key)
    assert first.status == 200 and first.body == BINARY
    [(_, _, _, _, body, encoding)] = stored(db, key)
    assert encoding == "base64" and base64.b64decode(body) == BINARY
    again = post(server, "/binary", key=key)
    assert again.status == 200 and again.replayed and again.body == BINARY
    assert again.headers["content-type"] == first.headers["content-type"]
    assert ":idem-body-encoding" not in again.headers


def test_an_exception_rolls_back_and_releases_the_key(server, db):
    body, key = order(), str(uuid.uuid4())
    assert post(server, "/boom", body, key).status == 500
    assert rows(db, body["sku"]) == 0 and stored(db, key) == []
    again = post(server, "/boom", body, key)
    assert again.status == 500 and not again.replayed  # it ran again


def test_a_response_too_large_to_store_rolls_everything_back(server, db):
    # fails before the fix: the writes were committed, the key released,
    # and the answer a 201 (the retry then wrote the row again)
    body, key = order(), str(uuid.uuid4())
    first = post(server, "/too-large", body, key)
    assert first.status == 500, first.body
    assert first.headers["content-type"] == "application/problem+json"
    assert "too large to store" in first.json()["detail"]
    assert "nothing was done" in first.json()["detail"]
    assert rows(db, body["sku"]) == 0 and stored(db, key) == []
    again = post(server, "/too-large", body, key)  # claimed again: it ran again
    assert again.status == 500 and not again.replayed
    assert "too large to store" in again.json()["detail"]
    assert rows(db, body["sku"]) == 0 and stored(db, key) == []


def test_keys_are_scoped_to_the_principal(server, db):
    body, key = order(), str(uuid.uuid4())
    replies = [post(server, "/orders", body, key, Authorization=f"Bearer {name}")
               for name in ("alice", "bob")] + [post(server, "/orders", body, key)]
    assert [r.status for r in replies] == [201, 201, 201]
    assert len({r.json()["id"] for r in replies}) == 3 and rows(db, body["sku"]) == 3
    assert sorted(s[0] for s in stored(db, key)) == [
        "alice:POST /orders", "anonymous:POST /orders", "bob:POST /orders"]
    again = post(server, "/orders", body, key, Authorization="Bearer bob")
    assert again.replayed and again.body == replies[1].body


def test_two_transactions_the_heartbeat_keeps_the_key(server, db):
    GATE.clear()
    key = str(uuid.uuid4())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(post, server, "/slow", key=key)
        first_lease = wait_for_checkpoint(db, key, "started")[3]
        # past the claim's own lease (1.2 s): only the heartbeat holds it now
        db.execute("SELECT pg_sleep_until(%s + interval '100 ms')", (first_lease,))
        duplicate = post(server, "/slow", key=key)
        assert duplicate.status == 409, duplicate.body
        # the seconds left of the 1.2 s lease the heartbeat renews, rounded up
        assert 1 <= int(duplicate.headers["retry-after"]) <= 2
        assert stored(db, key)[0][3] > first_lease
        GATE.set()
        first = slow.result()
    assert first.status == 200 and first.json() == {"attempt": 1, "recovery_point": None}
    again = post(server, "/slow", key=key)
    assert again.replayed and again.body == first.body


def test_two_transactions_a_takeover_gets_the_recovery_point(server, db):
    GATE.set()
    key = str(uuid.uuid4())
    # attempt 1 claimed, checkpointed, and died; its lease runs out
    db.execute("SELECT FROM idempotency.idem_claim('anonymous:POST /slow', %s, lease => '10 ms')",
               (key,))
    db.execute("SELECT idempotency.idem_checkpoint('anonymous:POST /slow', %s, 'charged', 1)",
               (key,))
    db.execute("SELECT pg_sleep_until(lease_expires_at) FROM idempotency.keys WHERE key = %s",
               (key,))
    reply = post(server, "/slow", key=key)
    assert reply.status == 200 and reply.json() == {"attempt": 2, "recovery_point": "charged"}


def test_two_transactions_a_lost_key_answers_409(server, db):
    GATE.clear()
    key = str(uuid.uuid4())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(post, server, "/slow", key=key)
        wait_for_checkpoint(db, key, "started")
        # the lease ran out, and a retry took the key over (tried again if
        # the heartbeat extended the lease in between)
        for _ in range(100):
            db.execute("""UPDATE idempotency.keys SET lease_expires_at = clock_timestamp()
                          WHERE key = %s""", (key,))
            taken = db.execute("""SELECT outcome, attempt FROM idempotency.idem_claim(
                                  'anonymous:POST /slow', %s, lease => '1 minute')""",
                               (key,)).fetchone()
            if taken[0] != "in_progress":
                break
        assert tuple(taken) == ("claimed", 2)
        GATE.set()
        reply = slow.result()
    assert reply.status == 409 and reply.headers["content-type"] == "application/problem+json"
    assert stored(db, key)[0][1] == 2  # the new attempt's, untouched


@pytest.mark.parametrize("adapter", ["asgi", "flask"])
@pytest.mark.parametrize("status, policy, kept", [
    (409, "409", False),     # the default stores a 409: the guard before COMMIT
    (201, "201,409", False),
    # an empty list (" ": "" is unset in the SQL edition) stores a 503 the
    # default releases: complete, then COMMIT
    (503, " ", True),
    (409, " ", True),
])
def test_the_servers_release_policy_decides(status, policy, kept, adapter, db):
    # the completion and COMMIT go in one query string when the default
    # policy stores the status: without the guard, a status the server's
    # policy releases would commit the handler's row with the key free
    body, key = {**order(), "status": status, "policy": policy}, str(uuid.uuid4())
    with contextlib.ExitStack() as stack:
        if adapter == "asgi":
            pool = AsyncConnectionPool("", open=False, min_size=1, kwargs=POOL_KWARGS)
            port = stack.enter_context(serve_asgi(starlette_app(pool)))
        else:
            pool = stack.enter_context(ConnectionPool("", open=True, min_size=1,
                                                      kwargs=POOL_KWARGS))
            port = stack.enter_context(serve_wsgi(flask_app(pool)))
        first = post(port, "/policy", body, key)
        assert first.status == status and first.json() == {"sku": body["sku"]}
        again = post(port, "/policy", body, key)
        assert again.status == status and again.replayed == kept
    assert rows(db, body["sku"]) == (1 if kept else 0) and bool(stored(db, key)) == kept


def test_asgi_a_request_body_over_the_limit_answers_413(db):
    pool = AsyncConnectionPool("", open=False, min_size=1, kwargs=POOL_KWARGS)
    with serve_asgi(starlette_app(pool, limit=100)) as port:
        # at the limit: read and handled
        at_limit, key = {"whole": "x" * (100 - len('{"whole": ""}'))}, str(uuid.uuid4())
        reply = post(port, "/echo", at_limit, key)
        assert reply.status == 200 and reply.json() == at_limit
        # over it, by its Content-Length or once read (chunked): 413, no claim
        for chunked in (False, True):
            key = str(uuid.uuid4())
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            headers = {"Idempotency-Key": key, "Content-Type": "application/json",
                       "Connection": "close"}
            data = b'{"whole": "' + b"x" * 200 + b'"}'
            if chunked:
                conn.request("POST", "/echo", iter([data[:50], data[50:]]), headers,
                             encode_chunked=True)
            else:
                conn.request("POST", "/echo", data, headers)
            response = conn.getresponse()
            problem = json.loads(response.read())
            conn.close()
            assert response.status == 413, chunked
            assert response.getheader("content-type") == "application/problem+json"
            assert problem["detail"] == "the request body is larger than 100 bytes"
            assert stored(db, key) == []


def test_a_scope_function_and_long_scopes_hashed(db):
    pool = AsyncConnectionPool("", open=False, min_size=1, kwargs=POOL_KWARGS)
    app = starlette_app(pool, scope=lambda request: request.headers["x-api-key"])
    body, key = order(), str(uuid.uuid4())
    long, shorter = "t" * 300, "t" * 255
    with serve_asgi(app) as port:
        assert post(port, "/orders", body, key, X_Api_Key=long).status == 201
        assert post(port, "/orders", body, key, X_Api_Key=shorter).status == 201
        assert post(port, "/orders", body, key, X_Api_Key=long).replayed
    assert rows(db, body["sku"]) == 2
    assert sorted(s[0] for s in stored(db, key)) == sorted(
        [shorter, "sha256:" + hashlib.sha256(long.encode()).hexdigest()])


def test_two_transactions_an_exception_stops_the_heartbeat_and_releases(server, db):
    key = str(uuid.uuid4())
    assert post(server, "/slow-boom", key=key).status == 500
    assert stored(db, key) == []  # released: the retry runs again
    # the threaded adapters join their heartbeat before answering
    assert not [t for t in threading.enumerate() if t.name == f"idempotency heartbeat {key}"]
    assert post(server, "/slow-boom", key=key).status == 500


def test_hostile_keys_and_paths(server, db):
    # a NUL byte (no text parameter holds it), bytes that are not UTF-8:
    # 400, never a 500; uvicorn's parser refuses the NUL itself, and may
    # reset the connection before its 400 is read
    try:
        assert post(server, "/orders", order(), "a\x00b").status == 400
    except (ConnectionResetError, BrokenPipeError):
        pass
    assert post(server, "/orders", order(), "\xff\xfe").status == 400
    # quotes and SQL are a key like any other, stored as sent
    unique = uuid.uuid4()
    for key in (f"x'); DROP TABLE orders; -- {unique}", f'"quoted \\"inner\\" {unique}"',
                f"back\\slash {unique}", f"caf\u00e9 {unique}".encode().decode("latin-1")):
        body = order()
        first = post(server, "/orders", body, key)
        assert first.status == 201 and post(server, "/orders", body, key).replayed
    assert stored(db, f'quoted "inner" {unique}')
    assert stored(db, f"x'); DROP TABLE orders; -- {unique}")
    assert stored(db, f"back\\slash {unique}")  # as sent: no escape read into it
    assert stored(db, f"caf\u00e9 {unique}")  # the header's UTF-8
    # %00 in the path: its scope is hashed, and the handler answers (404)
    key = str(uuid.uuid4())
    reply = post(server, "/orders%00", order(), key)
    assert reply.status == 404, reply.body
    [(scope, *_)] = stored(db, key)
    assert scope.startswith("sha256:")


@pytest.mark.parametrize("adapter", ["asgi", "flask"])
def test_failures_give_every_connection_back(adapter, db):
    """Exceptions, failed SQL, a two-transaction handler that raises, a
    response read from a file: a pool of two is whole again after each."""
    failing = ["/boom", "/sql-error", "/slow-boom"] + (["/file"] if adapter == "flask" else [])
    if adapter == "asgi":
        pool = AsyncConnectionPool("", open=False, min_size=2, max_size=2, timeout=5,
                                   kwargs=POOL_KWARGS)
        serve = serve_asgi(starlette_app(pool))
    else:
        pool = ConnectionPool("", open=True, min_size=2, max_size=2, timeout=5,
                              kwargs=POOL_KWARGS)
        pool.wait()  # both connections made (the lifespan does it for Starlette)
        serve = serve_wsgi(flask_app(pool))
    with serve as port:
        for path in failing * 3:
            reply = post(port, path, order(), str(uuid.uuid4()))
            assert reply.status == (200 if path == "/file" else 500), (path, reply.body)
            stats = pool.get_stats()
            assert stats["pool_available"] == stats["pool_size"] == 2, (path, stats)
        body = order()
        assert post(port, "/orders", body, str(uuid.uuid4())).status == 201
    if adapter == "flask":
        pool.close()
    assert rows(db, body["sku"]) == 1


def test_flask_send_file_is_stored_and_replayed(db):
    with ConnectionPool("", open=True, min_size=1, kwargs=POOL_KWARGS) as pool:
        with serve_wsgi(flask_app(pool)) as port:
            key = str(uuid.uuid4())
            first = post(port, "/file", key=key)
            assert first.status == 200 and first.body == BINARY
            again = post(port, "/file", key=key)
            assert again.replayed and again.body == BINARY
            assert again.headers["content-type"] == "application/octet-stream"


def test_asgi_a_client_that_leaves_mid_body_claims_nothing(db):
    pool = AsyncConnectionPool("", open=False, min_size=1, kwargs=POOL_KWARGS)
    app, finished = starlette_app(pool), threading.Event()

    async def served(scope, receive, send):  # says when a request is done with
        try:
            await app(scope, receive, send)
        finally:
            if scope["type"] == "http":
                finished.set()

    with serve_asgi(served) as port:
        key = str(uuid.uuid4())
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"POST /echo HTTP/1.1\r\nHost: test\r\n"
                           b"Content-Length: 100\r\nIdempotency-Key: " + key.encode() +
                           b"\r\n\r\n" + b'{"sku": "')
        assert finished.wait(30)
        # neither the partial body's 400 stored, nor a claim: the retry runs
        assert stored(db, key) == []
        reply = post(port, "/echo", {"whole": True}, key)
        assert reply.status == 200 and reply.json() == {"whole": True}


def test_django_under_asgi_an_async_view_runs_in_the_transaction(db):
    from django.core.asgi import get_asgi_application

    django_app()  # the settings
    with serve_asgi(get_asgi_application(), lifespan="off") as port:
        body, key = order(), str(uuid.uuid4())
        first = post(port, "/async-orders", body, key)
        assert first.status == 201, first.body
        again = post(port, "/async-orders", body, key)
        assert again.replayed and again.body == first.body
        # a 503 after the insert: released, and the insert rolled back with it
        failed, failed_key = order(), str(uuid.uuid4())
        assert post(port, "/async-orders", failed, failed_key, X_Fail_Status="503").status == 503
    assert rows(db, body["sku"]) == 1
    assert rows(db, failed["sku"]) == 0 and stored(db, failed_key) == []


@pytest.mark.parametrize("adapter", ["asgi", "flask"])
def test_a_header_sent_twice_is_replayed_twice(adapter, db):
    if adapter == "asgi":
        pool = AsyncConnectionPool("", open=False, min_size=1, kwargs=POOL_KWARGS)
        serve = serve_asgi(starlette_app(pool))
    else:
        pool = ConnectionPool("", open=True, min_size=1, kwargs=POOL_KWARGS)
        serve = serve_wsgi(flask_app(pool))
    key = str(uuid.uuid4())
    with serve as port:
        first = post(port, "/vary", key=key)
        again = post(port, "/vary", key=key)
    if adapter == "flask":
        pool.close()
    assert again.replayed and again.body == first.body == b"two Vary headers"
    assert [v for n, v in again.raw_headers if n == "vary"] == ["Accept", "Authorization"]
    assert again.headers["content-type"] == first.headers["content-type"]
    assert db.execute("SELECT headers->'vary' FROM idempotency.keys WHERE key = %s",
                      (key,)).fetchone()[0] == ["Accept", "Authorization"]


def test_asgi_background_tasks_run_after_the_commit_and_the_answer(db):
    pool = AsyncConnectionPool("", open=False, min_size=1, kwargs=POOL_KWARGS)
    BACKGROUND_GATE.clear()
    BACKGROUND_SAW.clear()
    with serve_asgi(starlette_app(pool)) as port:
        body = order()
        # answered while the task still waits for the gate
        reply = post(port, "/background", body, str(uuid.uuid4()))
        assert reply.status == 201 and not BACKGROUND_SAW
        BACKGROUND_GATE.set()
        for _ in range(3000):
            if BACKGROUND_SAW:
                break
            db.execute("SELECT pg_sleep(0.01)")
    assert BACKGROUND_SAW == [1]  # committed before the task ran


@pytest.mark.parametrize("path", ["/unfinished", "/slow-unfinished"])
def test_asgi_a_response_left_unfinished_is_not_stored(path, db):
    pool = AsyncConnectionPool("", open=False, min_size=1, kwargs=POOL_KWARGS)
    key = str(uuid.uuid4())
    with serve_asgi(starlette_app(pool)) as port:
        reply = post(port, path, key=key)
        assert reply.status == 500  # ServerErrorMiddleware's
    assert stored(db, key) == [] and rows(db, key) == 0
