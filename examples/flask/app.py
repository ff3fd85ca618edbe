"""POST /orders behind the Idempotency-Key extension, with Flask.

Run it with ./serve PORT (gunicorn); the database is libpq's environment
variables (PGHOST, PGPORT, PGUSER, PGDATABASE). A key is required; the
handler's insert and the key's answer commit in one transaction.

  IDEM_MIDDLEWARE=off   the same handler without the extension
  IDEM_TEST_HOOKS=1     obey X-Delay-Ms, X-Fail-Status and X-Crash (tests only)
  POOL_SIZE             database connections (10)

"Authorization: Bearer NAME" stands in for real authentication: it sets
g.user, which the default scope of the keys includes.
"""
import contextlib
import os
import signal

from flask import Flask, g, jsonify, request
from psycopg_pool import ConnectionPool

from pg_idempotency.flask import Idempotency

MIDDLEWARE = os.environ.get("IDEM_MIDDLEWARE", "on") != "off"
HOOKS = os.environ.get("IDEM_TEST_HOOKS") == "1"
SCHEMA = """CREATE TABLE IF NOT EXISTS orders (
    id bigserial PRIMARY KEY, sku text NOT NULL, qty integer NOT NULL)"""

# prepare_threshold=None: no prepared statements, for pgbouncer's
# transaction pooling; autocommit: the extension opens the transactions
pool = ConnectionPool("", open=True, min_size=int(os.environ.get("POOL_SIZE", "10")),
                      kwargs={"autocommit": True, "prepare_threshold": None})
with pool.connection() as conn:
    conn.execute(SCHEMA)

app = Flask(__name__)


@app.before_request
def authenticate():  # registered before the extension: g.user is set when it claims
    scheme, _, name = request.headers.get("Authorization", "").partition(" ")
    g.user = name if scheme.lower() == "bearer" and name else None


if MIDDLEWARE:
    Idempotency(app, pool=pool, required=True)


@contextlib.contextmanager
def database():
    """The extension's transaction; without it, a connection in autocommit."""
    if MIDDLEWARE:
        yield g.idempotency.conn
    else:
        with pool.connection() as conn:
            yield conn


@app.post("/orders")
def create_order():
    if HOOKS and "X-Fail-Status" in request.headers:
        return jsonify(error="failing as asked"), int(request.headers["X-Fail-Status"])
    order = request.get_json()
    with database() as conn:
        (order_id,) = conn.execute("INSERT INTO orders (sku, qty) VALUES (%s, %s) RETURNING id",
                                   (order["sku"], order["qty"])).fetchone()
        if HOOKS and "X-Delay-Ms" in request.headers:
            # in the database, so that a test sees the request at work there
            conn.execute("SELECT pg_sleep(%s)", (int(request.headers["X-Delay-Ms"]) / 1000,))
    if HOOKS and request.headers.get("X-Crash") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return (jsonify(id=order_id, sku=order["sku"], qty=order["qty"]), 201,
            {"Location": f"/orders/{order_id}"})
