"""Real servers for the package's tests: uvicorn and werkzeug in threads of
the test process, a real PostgreSQL from libpq's environment variables."""
import contextlib
import http.client
import json
import socket
import threading
import time

import psycopg
import pytest

SCHEMA = """CREATE TABLE IF NOT EXISTS orders (
    id bigserial PRIMARY KEY, sku text NOT NULL, qty integer NOT NULL)"""
# no prepared statements, no session state: pgbouncer's transaction pooling
POOL_KWARGS = {"autocommit": True, "prepare_threshold": None}


@pytest.fixture(scope="session")
def db():
    with psycopg.connect("", **POOL_KWARGS) as conn:
        conn.execute(SCHEMA)
        yield conn


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def serve_asgi(app, lifespan="on"):
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan=lifespan))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def serve_wsgi(app):
    from werkzeug.serving import make_server

    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_port
    finally:
        server.shutdown()
        thread.join(10)


class Reply:
    def __init__(self, status, headers, body):
        self.status, self.body = status, body
        self.raw_headers = [(name.lower(), value) for name, value in headers]
        self.headers = dict(self.raw_headers)

    def json(self):
        return json.loads(self.body)

    @property
    def replayed(self):
        return self.headers.get("idempotent-replayed") == "true"


def post(port, path, body=None, key=None, **headers):
    sent = {"Content-Type": "application/json", "Connection": "close",
            **{name.replace("_", "-"): value for name, value in headers.items()}}
    if key is not None:
        sent["Idempotency-Key"] = key
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, json.dumps(body or {}).encode(), sent)
        response = conn.getresponse()
        return Reply(response.status, response.getheaders(), response.read())
    finally:
        conn.close()
