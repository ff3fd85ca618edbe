"""doc/http.md's protocol, the same tests for each adapter (apps.py)."""
import base64
import concurrent.futures
import hashlib
import uuid

import pytest
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from apps import BINARY, GATE, django_app, flask_app, starlette_app
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
        assert int(duplicate.headers["retry-after"]) >= 1
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
