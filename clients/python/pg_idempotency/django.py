"""The Django middleware, on Django's own database connection.

    MIDDLEWARE = [
        ...
        "django.contrib.auth.middleware.AuthenticationMiddleware",
        "pg_idempotency.django.IdempotencyMiddleware",
    ]
    IDEMPOTENCY = {"required": True}

The view runs inside the middleware's ``transaction.atomic()``, on
``django.db.connection``: its writes and the key's answer commit together.
It works with every PostgreSQL driver Django supports (psycopg2, psycopg
3). The protocol is doc/http.md's.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

from django.conf import settings
from django.db import DatabaseError, connections, transaction
from django.http import HttpRequest, HttpResponse
from django.utils.module_loading import import_string

from ._protocol import (
    CLAIM, COMPLETE, LEASE_LEFT, ONE_TRANSACTION, RELEASE, Answer, Claim, Context, IdempotencyKeyLost,
    Options, bounded_scope, claim_times, complete_params, default_fingerprint, default_scope,
    is_lost_key, is_too_large, lost_key, missing_key, not_claimed, parse_key, too_large,
)
from ._sync import Heartbeat, checkpoint_with

__all__ = ["IdempotencyMiddleware", "IdempotencyKeyLost"]


def _response(answer: Answer) -> HttpResponse:
    response = HttpResponse(answer.body, status=answer.status)
    if not any(name.lower() == "content-type" for name, _ in answer.headers):
        del response["Content-Type"]
    values: dict[str, list[str]] = {}
    for name, value in answer.headers:
        values.setdefault(name, []).append(value)
    for name, sent in values.items():  # a Django response has each name once
        response[name] = ", ".join(sent)
    return response


def _principal(request: HttpRequest) -> Optional[str]:
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return None
    return str(user.pk)


class IdempotencyMiddleware:
    """Answers retried requests from the database (doc/http.md).

    Options come from the ``IDEMPOTENCY`` setting, a dict with doc/http.md's
    names (methods, required, scope, fingerprint, wait, lease, ttl, mode,
    store_headers) and ``using``, the database alias ("default").
    ``required``, ``mode``, ``scope`` and ``fingerprint`` may be functions
    of the request, or their dotted paths. Put it after
    AuthenticationMiddleware: the default scope's principal is
    ``request.user.pk``.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response
        options = dict(getattr(settings, "IDEMPOTENCY", {}))
        self.using: str = options.pop("using", "default")
        for name in ("required", "scope", "fingerprint", "mode"):
            value = options.get(name)
            if isinstance(value, str) and "." in value:
                options[name] = import_string(value)
        self.options: Options[HttpRequest] = Options(**options)

    def _run(self, sql: str, params: tuple[Any, ...]) -> Any:
        """One statement in a transaction of its own (or a savepoint)."""
        with transaction.atomic(using=self.using):
            return self._fetch(sql, params)

    def _fetch(self, sql: str, params: tuple[Any, ...]) -> Any:
        """One statement, in the transaction that is open: in the
        one-transaction mode an error rolls all of it back anyway, so no
        savepoint (two round trips each) is set around it."""
        with connections[self.using].cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.fetchone()

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.method not in self.options.methods:
            return self.get_response(request)
        raw = request.headers.get("Idempotency-Key")
        key = parse_key(None if raw is None else raw.encode("latin-1"))
        if key is None:
            if self.options.is_required(request):
                return _response(missing_key())
            return self.get_response(request)
        if isinstance(key, Answer):
            return _response(key)

        method = str(request.method)
        if self.options.scope is not None:
            scope = str(self.options.scope(request))
        else:
            scope = default_scope(_principal(request), method, request.path)
        scope = bounded_scope(scope)
        if self.options.fingerprint is not None:
            fingerprint = self.options.fingerprint(request)
        else:
            fingerprint = default_fingerprint(method, request.get_full_path(), request.body)
        mode = self.options.mode_of(request)
        params = (scope, key, fingerprint) + claim_times(self.options, mode)
        if mode == ONE_TRANSACTION:
            return self._one_transaction(request, key, scope, params)
        return self._two_transaction(request, key, scope, params)

    def _one_transaction(self, request: HttpRequest, key: str, scope: str,
                         params: tuple[Any, ...]) -> HttpResponse:
        with transaction.atomic(using=self.using):
            claim = Claim(*self._fetch(CLAIM, params))
            if claim.outcome != "claimed":
                if claim.needs_lease_left():
                    [claim.lease_left] = self._fetch(LEASE_LEFT, (claim.lease_expires_at,))
                return _response(not_claimed(claim))
            request.idempotency = Context(  # type: ignore[attr-defined]
                key, scope, ONE_TRANSACTION, claim.attempt, claim.recovery_point,
                conn=connections[self.using])
            # Django turns the view's exceptions into responses: a 500
            # releases the key below, and the writes are rolled back
            response = self.get_response(request)
            try:
                outcome = self._complete(request, response, scope, key, None)
            except DatabaseError as error:
                if not is_too_large(error):
                    raise
                # the handler's writes and the claim go: nothing was done
                transaction.set_rollback(True, using=self.using)
                answer = too_large(scope, key, error, released=False)
                return _response(answer)
            if outcome == "released":
                transaction.set_rollback(True, using=self.using)
        return response  # committed: the client may count on it

    def _complete(self, request: HttpRequest, response: HttpResponse, scope: str, key: str,
                  attempt: Optional[int]) -> str:
        if response.streaming:
            body = b"".join(response.streaming_content)  # type: ignore[attr-defined]
            response.streaming_content = [body]  # type: ignore[attr-defined]
        else:
            body = response.content
        params = complete_params(scope, key, response.status_code, list(response.headers.items()),
                                 body, self.options, attempt)
        if attempt is None:  # one transaction: a body too large raises
            return str(self._fetch(COMPLETE, params)[0])
        try:
            return str(self._run(COMPLETE, params)[0])
        except DatabaseError as error:
            if not is_too_large(error):
                raise
            too_large(scope, key, error, released=True)
            self._run(RELEASE, (scope, key, attempt))
            return "too large"

    def _two_transaction(self, request: HttpRequest, key: str, scope: str,
                         params: tuple[Any, ...]) -> HttpResponse:
        claim = Claim(*self._run(CLAIM, params))
        if claim.outcome != "claimed":
            if claim.needs_lease_left():
                [claim.lease_left] = self._run(LEASE_LEFT, (claim.lease_expires_at,))
            return _response(not_claimed(claim))
        context = Context(key, scope, "two_transaction", claim.attempt, claim.recovery_point)
        context._checkpoint = checkpoint_with(self._run, context)
        request.idempotency = context  # type: ignore[attr-defined]
        # the heartbeat's thread has a connection of its own, closed at its end
        heartbeat = Heartbeat(self._run, context, self.options,
                              done=lambda: connections[self.using].close())
        heartbeat.start()
        try:
            response = self.get_response(request)
        except BaseException:
            heartbeat.stop()
            with contextlib.suppress(DatabaseError):
                self._run(RELEASE, (scope, key, claim.attempt))
            raise
        heartbeat.stop()
        try:
            self._complete(request, response, scope, key, claim.attempt)
        except DatabaseError as error:
            if is_lost_key(error):
                return _response(lost_key())
            raise
        return response

    def process_exception(self, request: HttpRequest,
                          exception: Exception) -> Optional[HttpResponse]:
        if isinstance(exception, IdempotencyKeyLost):
            return _response(lost_key())
        return None
