"""POST /orders behind the Idempotency-Key middleware, with FastAPI.

Run it with ./serve PORT; the database is libpq's environment variables
(PGHOST, PGPORT, PGUSER, PGDATABASE). A key is required; the handler's
insert and the key's answer commit in one transaction.

  IDEM_MIDDLEWARE=off   the same handler without the middleware, for
                        bench/http.sh: its insert alone, in autocommit (one
                        round trip); with IDEM_BASELINE=transaction, in a
                        transaction of its own (BEGIN, the insert, COMMIT),
                        as the Express example's
  IDEM_TEST_HOOKS=1     obey X-Delay-Ms, X-Fail-Status and X-Crash (tests only)
  POOL_SIZE             database connections (10)

"Authorization: Bearer NAME" stands in for real authentication: Starlette's
AuthenticationMiddleware makes NAME the request's user, which the default
scope of the keys includes.
"""
import asyncio
import contextlib
import os
import signal
import sys
from typing import Any, AsyncIterator

import psycopg
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel
from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
from starlette.middleware.authentication import AuthenticationMiddleware

from pg_idempotency.asgi import IdempotencyMiddleware, idempotency_connection

MIDDLEWARE = os.environ.get("IDEM_MIDDLEWARE", "on") != "off"
HOOKS = os.environ.get("IDEM_TEST_HOOKS") == "1"
OWN_TRANSACTION = os.environ.get("IDEM_BASELINE") == "transaction"
SCHEMA = """CREATE TABLE IF NOT EXISTS orders (
    id bigserial PRIMARY KEY, sku text NOT NULL, qty integer NOT NULL)"""

# prepare_threshold=None: no prepared statements, for pgbouncer's
# transaction pooling; autocommit: the middleware opens the transactions
pool = AsyncConnectionPool("", open=False, min_size=int(os.environ.get("POOL_SIZE", "10")),
                           kwargs={"autocommit": True, "prepare_threshold": None})


class BearerUser(AuthenticationBackend):
    async def authenticate(self, conn: Any) -> Any:
        scheme, _, name = conn.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and name:
            return AuthCredentials(["authenticated"]), SimpleUser(name)
        return None


class Order(BaseModel):
    sku: str
    qty: int


async def own_connection() -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """Without the middleware: a connection of the pool, in autocommit."""
    async with pool.connection() as conn:
        yield conn


def own_transaction(conn: psycopg.AsyncConnection[Any]) -> Any:
    """IDEM_BASELINE=transaction without the middleware: the handler's
    writes in a transaction of its own, committed before it answers."""
    return conn.transaction() if not MIDDLEWARE and OWN_TRANSACTION else contextlib.nullcontext()


app = FastAPI()
if MIDDLEWARE:
    # added before AuthenticationMiddleware, so it runs inside it: after
    # request.user is set
    app.add_middleware(IdempotencyMiddleware, pool=pool, required=True)
app.add_middleware(AuthenticationMiddleware, backend=BearerUser())
database = idempotency_connection if MIDDLEWARE else own_connection


@app.post("/orders", status_code=201)
async def create_order(order: Order, request: Request,
                       conn: psycopg.AsyncConnection[Any] = Depends(database)):
    if HOOKS and "x-fail-status" in request.headers:
        status = int(request.headers["x-fail-status"])
        return JSONResponse({"error": "failing as asked"}, status_code=status)
    async with own_transaction(conn):
        cursor = await conn.execute(
            "INSERT INTO orders (sku, qty) VALUES (%s, %s) RETURNING id", (order.sku, order.qty))
        (order_id,) = await cursor.fetchone()
        if HOOKS and "x-delay-ms" in request.headers:
            # in the database, so that a test sees the request at work there
            await conn.execute("SELECT pg_sleep(%s)",
                               (int(request.headers["x-delay-ms"]) / 1000,))
        if HOOKS and request.headers.get("x-crash") == "1":
            os.kill(os.getpid(), signal.SIGKILL)
    return JSONResponse({"id": order_id, "sku": order.sku, "qty": order.qty}, status_code=201,
                        headers={"Location": f"/orders/{order_id}"})


async def main(port: int) -> None:
    await pool.open(wait=True)
    async with pool.connection() as conn:
        await conn.execute(SCHEMA)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", access_log=False))
    async def announce() -> None:  # what bench/http.sh waits for
        while not server.started:
            await asyncio.sleep(0.01)
        print(f"listening on http://127.0.0.1:{port}", flush=True)

    announced = asyncio.create_task(announce())
    try:
        await server.serve()
    finally:
        announced.cancel()
        await pool.close()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
