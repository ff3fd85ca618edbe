"""The Idempotency-Key protocol of doc/http.md, without any framework.

Each adapter (asgi, django, flask) reads the request its own way, then
calls what is here: the key's checks, the scope, the fingerprint, the SQL,
the answers that do not run the handler, and how a response is stored.
Every decision about a key is the extension's (idem_claim, idem_complete,
idem_release); nothing here keeps state between requests.
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
from dataclasses import dataclass, field
from datetime import timedelta
from http import HTTPStatus
from typing import Any, Callable, Collection, Generic, Iterable, Mapping, Optional, TypeVar, Union

log = logging.getLogger("pg_idempotency")

R = TypeVar("R")  # the framework's request

MAX_BYTES = 255
DEFAULT_METHODS = ("POST", "PATCH")
DEFAULT_LIMIT = 1024 * 1024  # bytes of a request body, as the Node package's limit
DEFAULT_STORE_HEADERS = ("content-type", "content-location", "location", "etag",
                         "last-modified", "cache-control", "vary")
ONE_TRANSACTION, TWO_TRANSACTION = "one_transaction", "two_transaction"
BODY_ENCODING = ":idem-body-encoding"  # no real header can have this name
REPLAYED = ("Idempotent-Replayed", "true")

# 22I01 not claimed, 22I02 already completed, 22I03 held by a later attempt:
# this attempt no longer owns its key (two-transaction mode).
LOST_KEY_STATES = frozenset({"22I01", "22I02", "22I03"})

Seconds = Union[float, timedelta]

# lease_expires_at: the holder's lease, NULL while its transaction is open.
# What a 409's Retry-After says is counted by the database's clock (which
# set the lease) only then (LEASE_LEFT): arithmetic in the claim costs the
# server more than a quarter of the claim on every request.
CLAIM = """SELECT outcome, status_code, body, headers::text, attempt, recovery_point, lease_expires_at
FROM idempotency.idem_claim(%s, %s, %s, ttl => %s, lease => %s, wait => %s)"""
LEASE_LEFT = "SELECT ceil(date_part('epoch', %s::timestamptz - clock_timestamp()))::int"
COMPLETE = "SELECT idempotency.idem_complete(%s, %s, %s, %s, %s::jsonb, %s)"
# One-transaction mode (ASGI), an answer the default policy stores: COMMIT
# follows in the same query string, and must not run if the server's
# policy (idempotency.release_statuses, which only idem_complete reads)
# releases it after all; then the division by zero (SQLSTATE RELEASED)
# aborts the transaction before COMMIT. The server logs that ERROR, so the
# answers the default policy releases take the path without the guard
# (idem_complete, then COMMIT or ROLLBACK): see likely_stored. The same as
# the Node package's.
COMPLETE_OR_ABORT = ("SELECT 1 / (idempotency.idem_complete(%s, %s, %s, %s, %s::jsonb, %s)"
                     " = 'stored')::int")
RELEASED = "22012"
RELEASE = "SELECT idempotency.idem_release(%s, %s, %s)"
CHECKPOINT = "SELECT idempotency.idem_checkpoint(%s, %s, %s, %s)"
EXTEND_LEASE = "SELECT idempotency.idem_extend_lease(%s, %s, %s, %s)"


class IdempotencyKeyLost(Exception):
    """This attempt lost its key: its lease ran out and a retry took it over.

    Raised by ``checkpoint`` in the two-transaction mode; the middleware
    answers 409, and the handler must stop without further side effects.
    """


def _interval(value: Optional[Seconds]) -> Optional[timedelta]:
    if value is None or isinstance(value, timedelta):
        return value
    return timedelta(seconds=value)


@dataclass
class Options(Generic[R]):
    """The middleware's options (doc/http.md), the same in every adapter.

    ``required`` and ``mode`` may be functions of the request, to set them
    per route; ``scope`` and ``fingerprint`` replace the defaults.
    """

    methods: Collection[str] = DEFAULT_METHODS
    required: Union[bool, Callable[[R], bool]] = False
    scope: Optional[Callable[[R], str]] = None
    fingerprint: Optional[Callable[[R], Optional[str]]] = None
    wait: Optional[Seconds] = 2.0
    lease: Optional[Seconds] = 60.0
    ttl: Optional[Seconds] = None
    mode: Union[str, Callable[[R], str]] = ONE_TRANSACTION
    store_headers: Collection[str] = DEFAULT_STORE_HEADERS
    limit: int = DEFAULT_LIMIT  # ASGI: the largest request body read (413 above)

    def __post_init__(self) -> None:
        self.methods = frozenset(m.upper() for m in self.methods)
        self.store_headers = frozenset(h.lower() for h in self.store_headers)
        self.wait, self.lease, self.ttl = (_interval(self.wait), _interval(self.lease),
                                           _interval(self.ttl))
        if isinstance(self.mode, str):
            check_mode(self.mode)
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 0:
            raise ValueError(f"limit must be a number of bytes, not {self.limit!r}")

    def is_required(self, request: R) -> bool:
        return self.required(request) if callable(self.required) else bool(self.required)

    def mode_of(self, request: R) -> str:
        return check_mode(self.mode(request) if callable(self.mode) else self.mode)

    def heartbeat_seconds(self) -> float:
        lease = _interval(self.lease) or timedelta(minutes=1)  # idempotency.lease's default
        return lease.total_seconds() / 3


def check_mode(mode: str) -> str:
    if mode not in (ONE_TRANSACTION, TWO_TRANSACTION):
        raise ValueError(f"mode must be {ONE_TRANSACTION!r} or {TWO_TRANSACTION!r}, not {mode!r}")
    return mode


@dataclass
class Answer:
    """A response the middleware gives itself (the handler does not run)."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes


def problem(status: int, detail: str, headers: Iterable[tuple[str, str]] = ()) -> Answer:
    """An RFC 9457 problem+json answer."""
    body = json.dumps({"type": "about:blank", "title": HTTPStatus(status).phrase,
                       "status": status, "detail": detail}).encode()
    return Answer(status, [("Content-Type", "application/problem+json"), *headers], body)


def parse_key(raw: Optional[bytes]) -> Union[str, Answer, None]:
    """The Idempotency-Key header's value: the key, a 400, or None if absent.

    A structured-field string ("...") is unquoted first.
    """
    if raw is None:
        return None
    value = raw.strip()
    if len(value) >= 2 and value[:1] == b'"' and value[-1:] == b'"':
        value = value[1:-1].replace(b'\\"', b'"').replace(b"\\\\", b"\\")
    if not value:
        return problem(400, "the Idempotency-Key header is empty")
    if len(value) > MAX_BYTES:
        return problem(400, f"the Idempotency-Key header is longer than {MAX_BYTES} bytes")
    if b"\x00" in value:  # a text parameter cannot hold it
        return problem(400, "the Idempotency-Key header contains a NUL byte")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return problem(400, "the Idempotency-Key header is not UTF-8")


def missing_key() -> Answer:
    return problem(400, "this request requires an Idempotency-Key header")


def body_too_large(limit: int) -> Answer:
    return problem(413, f"the request body is larger than {limit} bytes")


def likely_stored(status: int) -> bool:
    """Whether the extension's default idempotency.release_statuses (408,
    425, 429, 500-599) stores an answer: only a guess, to pick the path with
    the fewest round trips; idem_complete decides, under the server's policy."""
    return status < 500 and status not in (408, 425, 429)


def default_scope(principal: Optional[str], method: str, path: str) -> str:
    """``{principal}:{METHOD} {path}``, ``anonymous`` without a principal."""
    return f"{principal or 'anonymous'}:{method} {path}"


def bounded_scope(scope: str) -> str:
    """A scope over 255 bytes becomes ``sha256:`` and its hex digest.

    So does one with a NUL character (a path with ``%00``), which no text
    parameter can hold.
    """
    raw = scope.encode("utf-8")
    if len(raw) <= MAX_BYTES and "\x00" not in scope:
        return scope
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def default_fingerprint(method: str, path_with_query: str, body: bytes) -> str:
    """The hex SHA-256 of ``METHOD path?query\\n`` and the body's bytes."""
    return hashlib.sha256(f"{method} {path_with_query}\n".encode("utf-8") + body).hexdigest()


def principal_of(user: Any) -> Optional[str]:
    """A principal's name: its ``id`` (attribute or item), or the value itself."""
    if user is None:
        return None
    if hasattr(user, "id"):
        return str(user.id)
    try:
        return str(user["id"])
    except (KeyError, TypeError, IndexError):
        return str(user)


@dataclass
class Claim:
    """One row of idem_claim."""

    outcome: str
    status_code: Optional[int]
    body: Optional[str]
    headers: Optional[str]  # jsonb as text: the same on psycopg 2 and 3
    attempt: Optional[int]
    recovery_point: Optional[str]
    lease_expires_at: Any  # the holder's, as the driver reads it; None while its transaction is open
    lease_left: Optional[int] = None  # the seconds left of it, for a 409 (set by the adapter)

    def needs_lease_left(self) -> bool:
        """Whether a 409's Retry-After needs LEASE_LEFT run for it."""
        return self.outcome == "in_progress" and self.lease_expires_at is not None


def claim_times(options: Options[Any], mode: str) -> tuple[Any, ...]:
    """idem_claim's ttl, lease and wait (a lease only where the claim commits alone)."""
    lease = options.lease if mode == TWO_TRANSACTION else None
    return (options.ttl, lease, options.wait)


def not_claimed(claim: Claim) -> Answer:
    """The answer when idem_claim did not give us the key."""
    if claim.outcome == "replay":
        stored = json.loads(claim.headers) if claim.headers else {}
        body = decode_body(claim.body, stored)
        return Answer(claim.status_code or 200, [*replayed_headers(stored), REPLAYED], body)
    if claim.outcome == "in_progress":
        retry_after = max(1, claim.lease_left or 1)
        return problem(409, "a request with this Idempotency-Key is still in progress",
                       [("Retry-After", str(retry_after))])
    if claim.outcome == "mismatch":
        return problem(422, "this Idempotency-Key was used with another request")
    raise RuntimeError(f"idem_claim answered {claim.outcome!r}")


def too_large(scope: str, key: str, error: BaseException, released: bool) -> Answer:
    """idem_complete refused the handler's body (idempotency.max_response_bytes): logged.

    One-transaction mode (released False): the caller rolls the whole
    transaction back, the handler's writes and the claim with it, and
    answers this 500: nothing was done, and the request may be retried.
    Two-transaction mode (released True): the key was released, and the
    handler's own answer goes to the client; this one is not used.
    """
    log.warning("idempotency key %r in scope %r: response too large to store, %s: %s",
                key, scope, "key released" if released else "transaction rolled back", error)
    return problem(500, "the response was too large to store "
                        "(idempotency.max_response_bytes): nothing was done, "
                        "and the request may be retried")


def lost_key() -> Answer:
    return problem(409, "this request's Idempotency-Key was taken over by a retry")


# how the body is framed is the server's business on each answer, never stored
FRAMING_HEADERS = frozenset({"content-length", "transfer-encoding"})


StoredHeaders = dict[str, Union[str, list[str]]]


def stored_headers(headers: Iterable[tuple[str, str]], allow: Collection[str]) -> StoredHeaders:
    """The allow-listed headers, lower-cased; one sent more than once as the
    list of its values (as the Node package stores it), replayed as sent."""
    kept: StoredHeaders = {}
    for name, value in headers:
        name = name.lower()
        if name not in allow or name in FRAMING_HEADERS:
            continue
        if name not in kept:
            kept[name] = value
        else:
            before = kept[name]
            kept[name] = [*before, value] if isinstance(before, list) else [before, value]
    return kept


def replayed_headers(stored: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The stored headers as (name, value) pairs, a list's values one by one."""
    pairs = []
    for name, value in stored.items():
        if name == BODY_ENCODING:
            continue
        for one in value if isinstance(value, list) else [value]:
            pairs.append((name, str(one)))
    return pairs


def encode_body(body: bytes, headers: StoredHeaders) -> tuple[str, StoredHeaders]:
    """Text when the body is UTF-8 without NUL, else base64 and a marker header."""
    try:
        text = body.decode("utf-8")
        if "\x00" not in text:
            return text, headers
    except UnicodeDecodeError:
        pass
    return base64.b64encode(body).decode("ascii"), {**headers, BODY_ENCODING: "base64"}


def decode_body(text: Optional[str], headers: Mapping[str, Any]) -> bytes:
    if text is None:
        return b""
    if headers.get(BODY_ENCODING) == "base64":
        return base64.b64decode(text)
    return text.encode("utf-8")


def complete_params(scope: str, key: str, status: int, headers: Iterable[tuple[str, str]],
                    body: bytes, options: Options[Any], attempt: Optional[int]) -> tuple[Any, ...]:
    text, kept = encode_body(body, stored_headers(headers, options.store_headers))
    return (scope, key, status, text, json.dumps(kept), attempt)


def sqlstate(exc: Optional[BaseException]) -> Optional[str]:
    """The SQLSTATE of a psycopg or psycopg2 error, also wrapped (Django)."""
    while exc is not None:
        code = getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)
        if code:
            return str(code)
        exc = exc.__cause__
    return None


def is_lost_key(exc: BaseException) -> bool:
    return sqlstate(exc) in LOST_KEY_STATES


def is_too_large(exc: BaseException) -> bool:
    """idem_complete refused a body over idempotency.max_response_bytes."""
    return sqlstate(exc) == "54000"


@dataclass
class Context:
    """What the handler gets: ``request.state.idempotency``, ``g.idempotency``...

    ``conn`` is the transaction of the claim (one-transaction mode; None in
    the two-transaction mode). ``attempt`` and ``recovery_point`` come from
    the claim: an attempt above 1 took the key over, and ``recovery_point``
    is how far the last attempt got (``checkpoint``). ``lost`` turns true
    when the heartbeat or a checkpoint finds that a retry took the key over.
    """

    key: str
    scope: str
    mode: str
    attempt: Optional[int]
    recovery_point: Optional[str]
    conn: Any = None
    _checkpoint: Optional[Callable[[Optional[str]], Any]] = field(default=None, repr=False)
    lost: bool = False

    def checkpoint(self, recovery_point: Optional[str]) -> Any:
        """Record how far the handler got (two-transaction mode only).

        Raises IdempotencyKeyLost when a retry took the key over.
        """
        if self._checkpoint is None:
            raise RuntimeError("checkpoint is for the two_transaction mode")
        return self._checkpoint(recovery_point)
