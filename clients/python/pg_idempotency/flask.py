"""The Flask extension, on a psycopg 3 pool (psycopg_pool.ConnectionPool).

    idempotency = Idempotency(app, pool=pool, required=True)

    @app.post("/orders")
    def create_order():
        conn = g.idempotency.conn   # inside the transaction that claimed the key
        ...

The claim is made in ``before_request``, the answer stored and committed in
``after_request`` (before the response is sent), and ``teardown_request``
rolls back whatever a failure left open. The protocol is doc/http.md's.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import psycopg
from psycopg.pq import TransactionStatus
from flask import Flask, Response, current_app, g, request

from ._protocol import (
    CLAIM, COMPLETE, LEASE_LEFT, ONE_TRANSACTION, RELEASE,
    RELEASED, Answer, Claim, Context, IdempotencyKeyLost, Options, bounded_scope, claim_times,
    complete_params, default_fingerprint, default_scope, is_lost_key, is_too_large, likely_stored,
    lost_key, missing_key, not_claimed, parse_key, principal_of, problem, sqlstate, too_large,
)
from ._simple import BEGIN_CLAIM, COMMIT, COMPLETE_COMMIT, LEASE_LEFT_OF, claim_of, int_of
from ._sync import Heartbeat, checkpoint_with

__all__ = ["Idempotency", "IdempotencyKeyLost"]


def _fetch(conn: psycopg.Connection[Any], sql: str, params: tuple[Any, ...]) -> Any:
    # prepare=False: safe behind pgbouncer's transaction pooling
    return conn.execute(sql, params, prepare=False).fetchone()


class _State:
    """What a claimed request holds until its answer is stored."""

    def __init__(self, context: Context, transaction: Optional[contextlib.ExitStack] = None,
                 heartbeat: Optional[Heartbeat] = None) -> None:
        self.context, self.transaction, self.heartbeat = context, transaction, heartbeat

    def rollback(self) -> None:
        if self.transaction is not None:
            self.transaction.__exit__(psycopg.Rollback, psycopg.Rollback(), None)
            self.transaction = None

    def commit(self) -> None:
        if self.transaction is not None:
            transaction, self.transaction = self.transaction, None
            transaction.close()


class Idempotency:
    """Answers retried requests from the database (doc/http.md).

    ``pool`` is a psycopg_pool.ConnectionPool; the options are doc/http.md's
    (methods, required, scope, fingerprint, wait, lease, ttl, mode,
    store_headers); ``required``, ``mode``, ``scope`` and ``fingerprint``
    take Flask's ``request``. The default scope's principal is ``g.user``
    (its ``id`` when it has one).
    """

    def __init__(self, app: Optional[Flask] = None, *, pool: Any = None, **options: Any) -> None:
        self.pool = pool
        self.options: Options[Any] = Options(**options)
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask, *, pool: Any = None) -> None:
        if pool is not None:
            self.pool = pool
        if self.pool is None:
            raise ValueError("Idempotency needs a pool: Idempotency(app, pool=...)")
        app.extensions["idempotency"] = self
        app.before_request(self._claim)
        app.after_request(self._store)
        app.teardown_request(self._teardown)
        app.register_error_handler(IdempotencyKeyLost, lambda error: self._response(lost_key()))

    def _run(self, sql: str, params: tuple[Any, ...]) -> Any:
        with self.pool.connection() as conn, conn.transaction():
            return _fetch(conn, sql, params)

    @staticmethod
    def _response(answer: Answer) -> Response:
        response = current_app.response_class(answer.body, status=answer.status,
                                              headers=answer.headers)
        if not any(name.lower() == "content-type" for name, _ in answer.headers):
            del response.headers["Content-Type"]
        return response

    def _claim(self) -> Optional[Response]:
        if request.method not in self.options.methods:
            return None
        raw = request.headers.get("Idempotency-Key")
        key = parse_key(None if raw is None else raw.encode("latin-1"))
        if key is None:
            return self._response(missing_key()) if self.options.is_required(request) else None
        if isinstance(key, Answer):
            return self._response(key)

        body = request.get_data(cache=True)
        if self.options.scope is not None:
            scope = str(self.options.scope(request))
        else:
            scope = default_scope(principal_of(g.get("user")), request.method, request.path)
        scope = bounded_scope(scope)
        if self.options.fingerprint is not None:
            fingerprint = self.options.fingerprint(request)
        else:
            query = request.query_string.decode("latin-1")
            path = f"{request.path}?{query}" if query else request.path
            fingerprint = default_fingerprint(request.method, path, body)
        mode = self.options.mode_of(request)
        params = (scope, key, fingerprint) + claim_times(self.options, mode)

        if mode == ONE_TRANSACTION:
            transaction = contextlib.ExitStack()
            try:
                # the pool's connections are in autocommit: BEGIN is ours,
                # sent with the claim; leaving the pool's context with an
                # error rolls it back
                conn = transaction.enter_context(self.pool.connection())
                claim = claim_of(BEGIN_CLAIM.run(conn, params))
                if claim.needs_lease_left():
                    [left] = LEASE_LEFT_OF.run(conn, (claim.lease_expires_at,)) or [None]
                    claim.lease_left = int_of(left)
            except BaseException as error:  # the connection goes back to the pool
                transaction.__exit__(type(error), error, error.__traceback__)
                raise
            if claim.outcome != "claimed":
                with transaction:  # an error rolls back
                    COMMIT.run(conn)  # nothing was written
                return self._response(not_claimed(claim))
            g.idempotency = Context(key, scope, mode, claim.attempt, claim.recovery_point,
                                    conn=conn)
            g._idempotency_state = _State(g.idempotency, transaction)
            return None

        claim = Claim(*self._run(CLAIM, params))
        if claim.outcome != "claimed":
            if claim.needs_lease_left():
                [claim.lease_left] = self._run(LEASE_LEFT, (claim.lease_expires_at,))
            return self._response(not_claimed(claim))
        context = Context(key, scope, mode, claim.attempt, claim.recovery_point)
        context._checkpoint = checkpoint_with(self._run, context)
        heartbeat = Heartbeat(self._run, context, self.options)
        heartbeat.start()
        g.idempotency = context
        g._idempotency_state = _State(context, heartbeat=heartbeat)
        return None

    def _store(self, response: Response) -> Response:
        state: Optional[_State] = g.pop("_idempotency_state", None)
        if state is None:
            return response
        try:
            return self._store_answer(state, response)
        except BaseException:
            # the state is no longer on g, so teardown_request cannot see it:
            # free the key and return the connection here
            self._abandon(state)
            raise

    def _store_answer(self, state: _State, response: Response) -> Response:
        context = state.context
        if state.heartbeat is not None:
            state.heartbeat.stop()
        if response.direct_passthrough:  # send_file: read the file, to store it
            response.direct_passthrough = False
        params = complete_params(context.scope, context.key, response.status_code,
                                 list(response.headers.items()), response.get_data(),
                                 self.options, context.attempt)
        if state.transaction is not None:
            conn = context.conn
            if conn.info.transaction_status == TransactionStatus.INERROR:
                state.rollback()  # the handler's SQL failed: nothing was kept
                if response.status_code >= 500:
                    return response
                return self._response(problem(500, "the transaction failed"))
            try:
                stored = self._complete_and_commit(conn, response.status_code, params)
            except psycopg.Error as error:
                state.rollback()  # the handler's writes and the claim go: nothing was done
                if not is_too_large(error):
                    raise
                answer = too_large(context.scope, context.key, error, released=False)
                return self._response(answer)
            if stored:
                state.commit()
            else:  # a transient status, released: the writes are undone too
                state.rollback()
            return response
        try:
            with self.pool.connection() as conn, conn.transaction():
                self._complete(conn, params)
        except psycopg.Error as error:
            if is_lost_key(error):
                return self._response(lost_key())  # a retry took the key over
            raise
        return response

    @staticmethod
    def _complete_and_commit(conn: psycopg.Connection[Any], status: int,
                             params: tuple[Any, ...]) -> bool:
        """One-transaction mode: idem_complete, and COMMIT if it stored the
        answer (True); a body too large raises. An answer the extension's
        default policy stores: the completion and COMMIT in one round trip,
        behind the guard of COMPLETE_OR_ABORT should the server's policy
        release it after all. Any other: two."""
        if likely_stored(status):
            try:
                COMPLETE_COMMIT.run(conn, params)
            except psycopg.Error as error:
                if sqlstate(error) != RELEASED:
                    raise
                return False  # released by the server's policy
            return True
        if _fetch(conn, COMPLETE, params)[0] != "stored":
            return False
        COMMIT.run(conn)
        return True

    @staticmethod
    def _complete(conn: psycopg.Connection[Any], params: tuple[Any, ...]) -> str:
        """idem_complete in the two-transaction mode: a body too large releases
        the key."""
        scope, key, attempt = params[0], params[1], params[5]
        try:
            with conn.transaction():  # a savepoint: the release follows
                return str(_fetch(conn, COMPLETE, params)[0])
        except psycopg.errors.ProgramLimitExceeded as error:
            if not is_too_large(error):
                raise
            too_large(scope, key, error, released=True)
            _fetch(conn, RELEASE, (scope, key, attempt))
            return "too large"

    def _teardown(self, error: Optional[BaseException]) -> None:
        """A request that never reached after_request: roll back, release."""
        state: Optional[_State] = g.pop("_idempotency_state", None)
        if state is not None:
            self._abandon(state)

    def _abandon(self, state: _State) -> None:
        """Stop the heartbeat, free the key, give the connection back."""
        if state.heartbeat is not None:
            state.heartbeat.stop()
            with contextlib.suppress(psycopg.Error):  # lost already, or the database is gone
                self._run(RELEASE, (state.context.scope, state.context.key,
                                    state.context.attempt))
        state.rollback()
