"""The ASGI middleware, for Starlette and FastAPI, on a psycopg 3 async pool.

    app.add_middleware(IdempotencyMiddleware, pool=pool, required=True)

    @app.post("/orders", status_code=201)
    async def create_order(order: Order,
                           conn: AsyncConnection = Depends(idempotency_connection)):
        ...   # conn is inside the transaction that claimed the key

The protocol is doc/http.md's; the shared parts are in _protocol.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from typing import Any, Awaitable, Callable, MutableMapping, Optional

import psycopg
from psycopg import AsyncConnection, pq
from starlette.datastructures import URL
from starlette.requests import Request

from ._protocol import (
    CHECKPOINT, CLAIM, COMPLETE, EXTEND_LEASE, LEASE_LEFT,
    ONE_TRANSACTION, RELEASE, RELEASED, Answer, Claim, Context, IdempotencyKeyLost, Options,
    body_too_large, bounded_scope, check_mode, claim_times, complete_params, default_fingerprint,
    default_scope, is_lost_key, is_too_large, likely_stored, lost_key, missing_key, not_claimed,
    parse_key, sqlstate, too_large,
)
from ._simple import BEGIN_CLAIM, COMPLETE_COMMIT, LEASE_LEFT_OF, ROLLBACK, claim_of, int_of

__all__ = ["IdempotencyMiddleware", "idempotency_connection", "IdempotencyKeyLost"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("pg_idempotency")


async def idempotency_connection(request: Request) -> AsyncConnection[Any]:
    """FastAPI dependency: the connection inside the claim's transaction.

    async, so that FastAPI calls it on the event loop rather than in its
    thread pool (a thread hop per request, a third of the middleware's cost).
    """
    context: Optional[Context] = getattr(request.state, "idempotency", None)
    conn: Optional[AsyncConnection[Any]] = None if context is None else context.conn
    if conn is None:
        raise RuntimeError("no idempotency transaction: the request has no Idempotency-Key, "
                           "or its route is in the two_transaction mode")
    return conn


def principal(scope: Scope) -> Optional[str]:
    """Starlette's request.user, when AuthenticationMiddleware authenticated one."""
    user = scope.get("user")
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    try:
        return str(user.identity)
    except (AttributeError, NotImplementedError):
        return str(user.display_name)


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class _Buffered:
    """The handler's response, kept until the key's answer is committed."""

    def __init__(self) -> None:
        self.status = 500
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.complete = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status, self.headers = message["status"], list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            self.chunks.append(message.get("body", b""))
            self.complete = not message.get("more_body", False)

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def header_pairs(self) -> list[tuple[str, str]]:
        return [(n.decode("latin-1"), v.decode("latin-1")) for n, v in self.headers]


async def _send_answer(send: Send, answer: Answer) -> None:
    headers = [(n.lower().encode("latin-1"), v.encode("latin-1")) for n, v in answer.headers]
    headers.append((b"content-length", str(len(answer.body)).encode()))
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})


async def _send_buffered(send: Send, response: _Buffered) -> None:
    await send({"type": "http.response.start", "status": response.status,
                "headers": response.headers})
    await send({"type": "http.response.body", "body": response.body})


async def _fetch(conn: AsyncConnection[Any], sql: str, params: tuple[Any, ...]) -> Any:
    # prepare=False: never a prepared statement, so pgbouncer's transaction
    # pooling is safe whatever the pool's prepare_threshold
    cursor = await conn.execute(sql, params, prepare=False)
    return await cursor.fetchone()


async def _rollback(conn: AsyncConnection[Any]) -> None:
    """ROLLBACK; a connection that cannot is broken, and the pool discards it
    (one left in a transaction, the pool rolls back itself)."""
    if conn.pgconn.transaction_status == pq.TransactionStatus.IDLE:
        return  # a COMMIT that failed ended it
    with contextlib.suppress(psycopg.Error):
        await ROLLBACK.send(conn, ())


class IdempotencyMiddleware:
    """Answers retried requests from the database (doc/http.md).

    ``pool`` is a psycopg_pool.AsyncConnectionPool; the options are those
    of doc/http.md: methods, required, scope, fingerprint, wait, lease, ttl,
    mode ("one_transaction" or "two_transaction"), store_headers, and
    limit (the largest request body read, 413 above). ``required``,
    ``mode``, ``scope`` and ``fingerprint`` take a Starlette Request and
    may be async; the last three are called once the body is read
    (``await request.body()``), ``required`` (asked only when the key is
    missing) before.
    """

    def __init__(self, app: ASGIApp, *, pool: Any, **options: Any) -> None:
        self.app, self.pool = app, pool
        self.options: Options[Request] = Options(**options)
        # whether a function of the request must see a Starlette Request
        self.asks_request = (self.options.scope is not None or
                             self.options.fingerprint is not None or callable(self.options.mode))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in self.options.methods:
            return await self.app(scope, receive, send)
        raw = declared = None
        for name, value in scope["headers"]:
            if name == b"idempotency-key":
                raw = value if raw is None else raw
            elif name == b"content-length":
                declared = value
        key = parse_key(raw)
        if key is None:
            if await _maybe_await(self.options.is_required(Request(scope))):
                return await _send_answer(send, missing_key())
            return await self.app(scope, receive, send)
        if isinstance(key, Answer):
            return await _send_answer(send, key)

        limit = self.options.limit
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await _send_answer(send, body_too_large(limit))  # not read at all
        body = await _read_body(receive, limit)
        if body is None:  # the client left before its body arrived: nothing to answer
            return
        if body is _TOO_LARGE:
            return await _send_answer(send, body_too_large(limit))
        assert isinstance(body, bytes)
        request: Optional[Request] = None
        if self.asks_request:
            request = Request(scope, _replaying(body, receive))
            await request.body()  # read once, cached for the options' functions
        receive = _replaying(body, receive)  # the handler's
        key_scope = bounded_scope(await self._scope(scope, request))
        fingerprint = await self._fingerprint(scope, request, body)
        mode = self.options.mode
        if callable(mode):
            mode = check_mode(await _maybe_await(mode(request)))
        params = (key_scope, key, fingerprint, self.options, mode)
        if mode == ONE_TRANSACTION:
            answer = await self._one_transaction(scope, receive, send, *params)
        else:
            answer = await self._two_transaction(scope, receive, send, *params)
        if answer is not None:
            await _send_answer(send, answer)

    async def _scope(self, scope: Scope, request: Optional[Request]) -> str:
        if self.options.scope is not None:
            return str(await _maybe_await(self.options.scope(request)))
        # the path as Starlette's request.url.path reads it
        return default_scope(principal(scope), scope["method"], URL(scope=scope).path)

    async def _fingerprint(self, scope: Scope, request: Optional[Request],
                           body: bytes) -> Optional[str]:
        if self.options.fingerprint is not None:
            fingerprint = await _maybe_await(self.options.fingerprint(request))
            return None if fingerprint is None else str(fingerprint)
        path = scope.get("root_path", "") + scope["path"]
        query = scope.get("query_string", b"").decode("latin-1")
        return default_fingerprint(scope["method"], f"{path}?{query}" if query else path, body)

    async def _one_transaction(self, scope: Scope, receive: Receive, send: Send, key_scope: str,
                               key: str, fingerprint: Optional[str], options: Options[Request],
                               mode: str) -> Optional[Answer]:
        """Claim, run the handler, store and commit, then send its response.

        Two round trips of the middleware's own, as in the Node package:
        BEGIN with the claim, and the completion with COMMIT. A key not
        claimed is answered before the ROLLBACK of its transaction (which
        wrote nothing). The response is sent as soon as the handler has
        given all of it and the transaction has committed, not when the
        handler returns: Starlette's background tasks run after that,
        outside the transaction. Returns the answer to send when the
        handler did not run.
        """
        async with self.pool.connection() as conn:
            try:
                claim = claim_of(await BEGIN_CLAIM.send(
                    conn, (key_scope, key, fingerprint) + claim_times(options, mode), row_of=1))
                if claim.needs_lease_left():
                    [left] = await LEASE_LEFT_OF.send(conn, (claim.lease_expires_at,)) or [None]
                    claim.lease_left = int_of(left)
                answer = None if claim.outcome == "claimed" else not_claimed(claim)
            except BaseException:
                await _rollback(conn)
                raise
            if answer is not None:
                await _send_answer(send, answer)
                await _rollback(conn)
                return None
            scope.setdefault("state", {})["idempotency"] = Context(
                key, key_scope, mode, claim.attempt, claim.recovery_point, conn=conn)
            response, ended = _Buffered(), False

            async def end(error: Optional[BaseException]) -> None:
                """Commit (or roll back) once; then the client gets the response."""
                nonlocal ended
                if ended:
                    return
                ended = True
                if error is not None:  # claim and writes rolled back
                    await _rollback(conn)
                    return
                try:
                    await self._complete_and_commit(conn, key_scope, key, response)
                except BaseException as failed:
                    await _rollback(conn)
                    if not is_too_large(failed):
                        raise  # a failed COMMIT reaches the client as a 500
                    # the handler's writes and the claim go: nothing was done
                    await _send_answer(send, too_large(key_scope, key, failed, released=False))
                    return
                await _send_buffered(send, response)

            async def send_at_end(message: Message) -> None:
                if ended:
                    return  # nothing after the response's end
                await response.send(message)
                if response.complete:
                    await end(None)

            try:
                await self.app(scope, receive, send_at_end)
                if not ended:
                    raise _unfinished()
            except BaseException as error:
                await end(error)
                raise
        return None

    async def _complete_and_commit(self, conn: AsyncConnection[Any], key_scope: str, key: str,
                                   response: _Buffered) -> None:
        """idem_complete, then COMMIT if it stored the answer, else ROLLBACK
        (the handler's writes go with a released key).

        An answer the extension's default policy stores: the completion and
        COMMIT in one round trip, behind the guard of COMPLETE_OR_ABORT,
        should the server's policy release it after all. Any other: two.
        """
        params = complete_params(key_scope, key, response.status, response.header_pairs(),
                                 response.body, self.options, None)
        if likely_stored(response.status):
            try:
                await COMPLETE_COMMIT.send(conn, params)
            except psycopg.Error as error:
                if sqlstate(error) != RELEASED:
                    raise
                await _rollback(conn)  # released by the server's policy
            return
        if (await _fetch(conn, COMPLETE, params))[0] == "stored":
            await conn.commit()  # a failure reaches the client as a 500
        else:
            await _rollback(conn)

    async def _complete(self, conn: AsyncConnection[Any], key_scope: str, key: str,
                        response: _Buffered, attempt: int) -> str:
        """idem_complete in the two-transaction mode, fenced by the attempt; a
        body too large releases the key."""
        params = complete_params(key_scope, key, response.status, response.header_pairs(),
                                 response.body, self.options, attempt)
        try:
            async with conn.transaction():  # a savepoint: the release follows
                return str((await _fetch(conn, COMPLETE, params))[0])
        except psycopg.errors.ProgramLimitExceeded as error:
            if not is_too_large(error):
                raise
            too_large(key_scope, key, error, released=True)
            await _fetch(conn, RELEASE, (key_scope, key, attempt))
            return "too large"

    async def _run(self, sql: str, params: tuple[Any, ...]) -> Any:
        """One statement in a transaction of its own (autocommit's, or BEGIN and COMMIT)."""
        async with self.pool.connection() as conn:
            if conn.autocommit:
                return await _fetch(conn, sql, params)
            async with conn.transaction():
                return await _fetch(conn, sql, params)

    async def _two_transaction(self, scope: Scope, receive: Receive, send: Send, key_scope: str,
                               key: str, fingerprint: Optional[str], options: Options[Request],
                               mode: str) -> Optional[Answer]:
        claim = Claim(*await self._run(CLAIM, (key_scope, key, fingerprint) +
                                       claim_times(options, mode)))
        if claim.outcome != "claimed":
            if claim.needs_lease_left():
                [claim.lease_left] = await self._run(LEASE_LEFT, (claim.lease_expires_at,))
            return not_claimed(claim)
        attempt = claim.attempt
        context = Context(key, key_scope, mode, attempt, claim.recovery_point)

        async def checkpoint(point: Optional[str]) -> None:
            try:
                await self._run(CHECKPOINT, (key_scope, key, point, attempt))
            except psycopg.Error as error:
                if is_lost_key(error):
                    context.lost = True
                    raise IdempotencyKeyLost(str(error)) from error
                raise

        context._checkpoint = checkpoint
        scope.setdefault("state", {})["idempotency"] = context
        heartbeat = asyncio.create_task(self._heartbeat(context))
        response, ended = _Buffered(), False

        async def stop_heartbeat() -> None:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat

        async def end() -> None:
            """Store the answer (fenced by the attempt), then send it; once."""
            nonlocal ended
            if ended:
                return
            ended = True
            await stop_heartbeat()
            try:
                async with self.pool.connection() as conn:
                    async with conn.transaction():
                        await self._complete(conn, key_scope, key, response, attempt)
            except psycopg.Error as error:
                if not is_lost_key(error):
                    raise
                await _send_answer(send, lost_key())  # a retry took the key over
                return
            await _send_buffered(send, response)

        async def send_at_end(message: Message) -> None:
            if ended:
                return  # nothing after the response's end
            await response.send(message)
            if response.complete:
                await end()

        try:
            await self.app(scope, receive, send_at_end)
        except IdempotencyKeyLost:
            if ended:
                raise
            ended = True
            await stop_heartbeat()
            return lost_key()
        except BaseException:
            if ended:  # answered already: a background task failed
                raise
            ended = True
            await stop_heartbeat()
            # shielded: a cancelled request (the server's, or a task group's)
            # still frees its key rather than leave it to the lease
            release = asyncio.ensure_future(self._run(RELEASE, (key_scope, key, attempt)))
            with contextlib.suppress(psycopg.Error):  # lost already, or the database is gone
                await asyncio.shield(release)
            raise
        finally:
            if not heartbeat.done():
                await stop_heartbeat()
        if not ended:
            with contextlib.suppress(psycopg.Error):
                await self._run(RELEASE, (key_scope, key, attempt))
            raise _unfinished()
        return None

    async def _heartbeat(self, context: Context) -> None:
        """idem_extend_lease every third of the lease, until the key is lost."""
        every = self.options.heartbeat_seconds()
        while True:
            await asyncio.sleep(every)
            try:
                await self._run(EXTEND_LEASE, (context.scope, context.key, context.attempt,
                                               self.options.lease))
            except psycopg.Error as error:
                if is_lost_key(error):
                    context.lost = True
                    return
                log.warning("idempotency key %r: extending the lease failed: %s",
                            context.key, error)


def _unfinished() -> RuntimeError:
    """The app returned before its response's end (a StreamingResponse whose
    client left, say): what it sent is not stored, and its writes are undone."""
    return RuntimeError("the application returned without completing its response")


_TOO_LARGE = object()  # _read_body: the body is over the limit


async def _read_body(receive: Receive, limit: int) -> Any:
    """The whole request body; None if the client disconnected first, or
    _TOO_LARGE as soon as it is over ``limit`` bytes.

    A partial body must not be claimed nor reach the handler: its
    fingerprint is not the request's, and the handler's answer to it (a
    400, stored) would be replayed to the client's retry.
    """
    message = await receive()
    if message["type"] != "http.request":
        return None  # http.disconnect
    body = message.get("body", b"")
    if not message.get("more_body", False):  # the usual case: one message
        return body if len(body) <= limit else _TOO_LARGE
    chunks, length = [body], len(body)
    while True:
        if length > limit:
            return _TOO_LARGE
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        chunks.append(chunk)
        length += len(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks) if length <= limit else _TOO_LARGE


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the handler the body already read, then waits."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
