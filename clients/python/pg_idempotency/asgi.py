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
from psycopg import AsyncConnection
from starlette.requests import Request

from ._protocol import (
    CHECKPOINT, CLAIM, COMPLETE, EXTEND_LEASE, ONE_TRANSACTION, RELEASE, Answer, Claim,
    Context, IdempotencyKeyLost, Options, bounded_scope, check_mode, claim_times, complete_params,
    default_fingerprint, default_scope, is_lost_key, is_too_large, lost_key, missing_key,
    not_claimed, parse_key, too_large,
)

__all__ = ["IdempotencyMiddleware", "idempotency_connection", "IdempotencyKeyLost"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("pg_idempotency")


def idempotency_connection(request: Request) -> AsyncConnection[Any]:
    """FastAPI dependency: the connection inside the claim's transaction."""
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


class IdempotencyMiddleware:
    """Answers retried requests from the database (doc/http.md).

    ``pool`` is a psycopg_pool.AsyncConnectionPool; the options are those
    of doc/http.md: methods, required, scope, fingerprint, wait, lease, ttl,
    mode ("one_transaction" or "two_transaction") and store_headers.
    ``required``, ``mode``, ``scope`` and ``fingerprint`` take a Starlette
    Request and may be async; the last three are called once the body is
    read (``await request.body()``), ``required`` (asked only when the key
    is missing) before.
    """

    def __init__(self, app: ASGIApp, *, pool: Any, **options: Any) -> None:
        self.app, self.pool = app, pool
        self.options: Options[Request] = Options(**options)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in self.options.methods:
            return await self.app(scope, receive, send)
        raw = next((v for n, v in scope["headers"] if n == b"idempotency-key"), None)
        key = parse_key(raw)
        request = Request(scope)
        if key is None:
            if await _maybe_await(self.options.is_required(request)):
                return await _send_answer(send, missing_key())
            return await self.app(scope, receive, send)
        if isinstance(key, Answer):
            return await _send_answer(send, key)

        body = await _read_body(receive)
        if body is None:  # the client left before its body arrived: nothing to answer
            return
        request = Request(scope, _replaying(body, receive))
        await request.body()  # read once, cached for the options' functions
        receive = _replaying(body, receive)  # the handler's
        key_scope = bounded_scope(await self._scope(request))
        fingerprint = await self._fingerprint(request, body)
        mode = check_mode(await _maybe_await(
            self.options.mode(request) if callable(self.options.mode) else self.options.mode))
        params = (key_scope, key, fingerprint, self.options, mode)
        if mode == ONE_TRANSACTION:
            answer = await self._one_transaction(scope, receive, send, *params)
        else:
            answer = await self._two_transaction(scope, receive, send, *params)
        if answer is not None:
            await _send_answer(send, answer)

    async def _scope(self, request: Request) -> str:
        if self.options.scope is not None:
            return str(await _maybe_await(self.options.scope(request)))
        return default_scope(principal(request.scope), request.method, request.url.path)

    async def _fingerprint(self, request: Request, body: bytes) -> Optional[str]:
        if self.options.fingerprint is not None:
            fingerprint = await _maybe_await(self.options.fingerprint(request))
            return None if fingerprint is None else str(fingerprint)
        path = request.scope.get("root_path", "") + request.scope["path"]
        query = request.scope.get("query_string", b"").decode("latin-1")
        return default_fingerprint(request.method, f"{path}?{query}" if query else path, body)

    async def _one_transaction(self, scope: Scope, receive: Receive, send: Send, key_scope: str,
                               key: str, fingerprint: Optional[str], options: Options[Request],
                               mode: str) -> Optional[Answer]:
        """Claim, run the handler, store and commit, then send its response.

        The response is sent as soon as the handler has given all of it and
        the transaction has committed, not when the handler returns:
        Starlette's background tasks run after that, outside the transaction.
        Returns the answer to send when the handler did not run.
        """
        async with self.pool.connection() as conn:
            transaction = contextlib.AsyncExitStack()
            try:
                await transaction.enter_async_context(conn.transaction())
                claim = Claim(*await _fetch(conn, CLAIM, (key_scope, key, fingerprint) +
                                            claim_times(options, mode)))
            except BaseException as error:
                await transaction.__aexit__(type(error), error, error.__traceback__)
                raise
            if claim.outcome != "claimed":
                await transaction.aclose()
                return not_claimed(claim)
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
                    await transaction.__aexit__(type(error), error, error.__traceback__)
                    return
                try:
                    outcome = await self._complete(conn, key_scope, key, response, None)
                except BaseException as failed:
                    if not is_too_large(failed):
                        await transaction.__aexit__(type(failed), failed, failed.__traceback__)
                        raise
                    # the handler's writes and the claim go: nothing was done
                    await transaction.__aexit__(psycopg.Rollback, psycopg.Rollback(), None)
                    await _send_answer(send, too_large(key_scope, key, failed, released=False))
                    return
                if outcome == "released":  # a transient status: undo the writes too
                    await transaction.__aexit__(psycopg.Rollback, psycopg.Rollback(), None)
                else:
                    await transaction.aclose()  # COMMIT: a failure reaches the client as a 500
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

    async def _complete(self, conn: AsyncConnection[Any], key_scope: str, key: str,
                        response: _Buffered, attempt: Optional[int]) -> str:
        """idem_complete; a body too large raises in the one-transaction mode
        (attempt None), and releases the key in the two-transaction mode."""
        params = complete_params(key_scope, key, response.status, response.header_pairs(),
                                 response.body, self.options, attempt)
        if attempt is None:
            return str((await _fetch(conn, COMPLETE, params))[0])
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
        """One statement in a transaction of its own."""
        async with self.pool.connection() as conn:
            async with conn.transaction():
                return await _fetch(conn, sql, params)

    async def _two_transaction(self, scope: Scope, receive: Receive, send: Send, key_scope: str,
                               key: str, fingerprint: Optional[str], options: Options[Request],
                               mode: str) -> Optional[Answer]:
        claim = Claim(*await self._run(CLAIM, (key_scope, key, fingerprint) +
                                       claim_times(options, mode)))
        if claim.outcome != "claimed":
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


async def _read_body(receive: Receive) -> Optional[bytes]:
    """The whole request body, or None if the client disconnected first.

    A partial body must not be claimed nor reach the handler: its
    fingerprint is not the request's, and the handler's answer to it (a
    400, stored) would be replayed to the client's retry.
    """
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None  # http.disconnect
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


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
