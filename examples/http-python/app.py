#!/usr/bin/python3
"""A small JSON payments API honouring the Idempotency-Key header.

Standard library (http.server) plus Debian's python3-psycopg; every
idempotency decision is taken by the `idempotency` extension, in the
database that holds the payments.

  POST /payments   record a payment: one transaction (claim, insert, complete)
  POST /charges    charge the customer at an external provider first, then
                   record the payment: two transactions, a lease, checkpoints
  GET  /payments/<id>

The caller is named by the X-User header ("anonymous" without it); keys live
in the scope "{user}:{method} {path}", so two users never share a key.

Configuration, from the environment:

  PGHOST PGPORT PGUSER PGDATABASE ...  the database (libpq's variables),
                     or DATABASE_URL, a libpq connection string or URI
  HOST, PORT         where to listen (127.0.0.1:8000; PORT=0 picks a free port)
  PROVIDER_URL       the payment provider (http://127.0.0.1:8001)
  PROVIDER_TIMEOUT   seconds to wait for the provider (10)
  IDEM_LEASE         seconds a /charges claim is protected from takeover (30);
                     keep it well above PROVIDER_TIMEOUT
  POOL_SIZE          database connections at most (10)

Works unchanged through pgbouncer in transaction pooling mode: no prepared
statements (prepare_threshold=None) and no session state (no SET, temporary
tables, session advisory locks or LISTEN); every call below is one
transaction on its own or inside an explicit one.
"""
import contextlib
import datetime
import email.utils
import hashlib
import json
import os
import queue
import re
import sys
import threading
import traceback
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import namedtuple_row
from psycopg.types.json import Jsonb

PROVIDER_URL = os.environ.get("PROVIDER_URL", "http://127.0.0.1:8001")
PROVIDER_TIMEOUT = float(os.environ.get("PROVIDER_TIMEOUT", "10"))
LEASE = datetime.timedelta(seconds=float(os.environ.get("IDEM_LEASE", "30")))

SCHEMA = """
CREATE TABLE IF NOT EXISTS payments (
    id              bigserial PRIMARY KEY,
    user_name       text NOT NULL,
    amount          integer NOT NULL CHECK (amount > 0),
    currency        text NOT NULL,
    provider_charge text,            -- the provider's charge id (POST /charges)
    created_at      timestamptz NOT NULL DEFAULT now()
)"""

# The fingerprint is taken of the body as JSON (::jsonb), so the same
# request re-sent with other spacing or key order is still the same request.
# lease_left is what a 409's Retry-After says: the whole seconds, rounded up,
# until the holder's lease runs out (counted by the database's clock, which
# set the lease); NULL when the holder's transaction is still open.
CLAIM = """SELECT outcome, status_code, body, headers, attempt, recovery_point, expires_at,
                  ceil(extract(epoch FROM lease_expires_at - clock_timestamp()))::int AS lease_left
           FROM idempotency.idem_claim(%(scope)s, %(key)s,
                                       idempotency.idem_fingerprint(%(body)s::jsonb),
                                       lease => %(lease)s)"""
INSERT_PAYMENT = """INSERT INTO payments (user_name, amount, currency, provider_charge)
                    VALUES (%s, %s, %s, %s) RETURNING id"""
COMPLETE = "SELECT idempotency.idem_complete(%s, %s, %s, %s, %s, %s)"
CHECKPOINT = "SELECT idempotency.idem_checkpoint(%s, %s, %s, %s)"
RELEASE = "SELECT idempotency.idem_release(%s, %s, %s)"

# 22I01 not claimed, 22I02 already completed, 22I03 stale attempt: each means
# that this request no longer owns its key (its lease ran out and a retry
# took it over). It must stop; the client's next retry gets the answer.
LOST_KEY = {"22I01", "22I02", "22I03"}


class Response(Exception):
    """An HTTP answer: returned by the handlers, or raised to stop early."""

    def __init__(self, status, body, headers=None):
        self.status, self.headers = status, dict(headers or {})
        self.body = body if isinstance(body, str) else json.dumps(body)


def error(status, message, **headers):
    return Response(status, {"error": message}, headers)


class Pool:
    """A tiny thread-safe connection pool (psycopg_pool is another package).

    Connections are in autocommit: each statement is its own transaction
    unless it runs inside `with conn.transaction():`.
    """

    def __init__(self, conninfo, size):
        self.conninfo, self.idle = conninfo, queue.LifoQueue()
        self.slots = threading.BoundedSemaphore(size)

    @contextlib.contextmanager
    def connection(self):
        with self.slots:
            try:
                conn = self.idle.get_nowait()
            except queue.Empty:
                conn = psycopg.connect(self.conninfo, autocommit=True,
                                       prepare_threshold=None,  # pgbouncer
                                       row_factory=namedtuple_row)
            try:
                yield conn
            finally:
                if conn.info.transaction_status == TransactionStatus.IDLE:
                    self.idle.put(conn)
                else:  # broken, or left inside a transaction
                    conn.close()


pool = Pool(os.environ.get("DATABASE_URL", ""), int(os.environ.get("POOL_SIZE", "10")))


def claim_key(conn, scope, key, body, lease):
    try:
        return conn.execute(CLAIM, {"scope": scope, "key": key, "body": body,
                                    "lease": lease}).fetchone()
    except (psycopg.errors.InvalidTextRepresentation,  # JSON that jsonb refuses:
            psycopg.errors.UntranslatableCharacter):   # NaN, lone surrogates, \u0000
        raise error(400, "the body is not valid JSON")


def not_claimed(claim):
    """The answer when idem_claim did not give us the key (README table)."""
    if claim.outcome == "replay":
        # the stored response, byte for byte, marked as a replay, with when
        # the key expires (after that, the same key runs a new request)
        return Response(claim.status_code, claim.body or "",
                        {**(claim.headers or {}), "Idempotent-Replayed": "true",
                         "Idempotency-Expires": email.utils.format_datetime(
                             claim.expires_at.astimezone(datetime.timezone.utc), usegmt=True)})
    if claim.outcome == "in_progress":
        # when the holder's lease runs out, a retry can take the key over; a
        # holder whose transaction is open (no lease yet) is done in a moment
        retry_after = max(1, claim.lease_left) if claim.lease_left is not None else 1
        return error(409, "a request with this Idempotency-Key is in progress",
                     **{"Retry-After": str(retry_after)})
    if claim.outcome == "mismatch":
        return error(422, "this Idempotency-Key was used with another request")
    raise AssertionError(claim.outcome)


def lost_key(exc):
    if exc.sqlstate in LOST_KEY:
        return error(409, "this attempt was taken over by a retry", **{"Retry-After": "1"})
    raise exc


# -- POST /payments: one transaction ---------------------------------------

def create_payment(user, key, body, request):
    scope = f"{user}:POST /payments"
    with pool.connection() as conn, conn.transaction():
        # Claim, business write and completion commit together or not at
        # all: if anything fails before COMMIT, the claim vanishes with the
        # payment and a retry runs the request again; once committed, the
        # payment exists and so does the response every retry replays.
        # Duplicates arriving meanwhile get in_progress at once (no waiting).
        claim = claim_key(conn, scope, key, body, lease=None)
        if claim.outcome != "claimed":
            return not_claimed(claim)
        (payment_id,) = conn.execute(INSERT_PAYMENT, (user, request["amount"],
                                                      request["currency"], None)).fetchone()
        answer = Response(201, {"id": payment_id, "amount": request["amount"],
                                "currency": request["currency"]},
                          {"Location": f"/payments/{payment_id}"})
        conn.execute(COMPLETE, (scope, key, answer.status, answer.body,
                                Jsonb(answer.headers), None))
        return answer


# -- POST /charges: two transactions around an external call --------------

class ProviderError(Exception):
    pass


def provider_charge(reference, user, request):
    """Charge at the provider. `reference` is the provider's own idempotency
    key: the same reference never charges twice, however often it is sent."""
    data = json.dumps({"reference": reference, "customer": user,
                       "amount": request["amount"], "currency": request["currency"]})
    req = urllib.request.Request(f"{PROVIDER_URL}/charges", data=data.encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=PROVIDER_TIMEOUT) as response:
            return json.load(response)["id"]
    except (OSError, ValueError, KeyError) as exc:  # HTTP error, timeout, refused, garbage
        raise ProviderError(str(exc)) from exc


def create_charge(user, key, body, request):
    scope = f"{user}:POST /charges"
    # 1. Claim, committed on its own, with a lease: the provider call must
    #    not run inside a transaction (no connection is held while waiting
    #    for it), so the claim has to be visible to retries before it. If
    #    this process dies, the lease runs out and a retry takes the key over.
    with pool.connection() as conn:
        claim = claim_key(conn, scope, key, body, lease=LEASE)
    if claim.outcome != "claimed":
        return not_claimed(claim)
    attempt = claim.attempt  # fencing token for every later call
    try:
        if claim.recovery_point:
            # 2a. A takeover (attempt > 1) of a request whose process died
            #     after the provider charged: resume, do not charge again.
            charge = claim.recovery_point.removeprefix("charged ")
        else:
            # 2b. Call the provider outside any transaction. Its reference is
            #     derived from our key, so if we die before the checkpoint
            #     below, the retry's call is answered with the same charge.
            reference = hashlib.sha256(f"{scope}\n{key}".encode()).hexdigest()
            try:
                charge = provider_charge(reference, user, request)
            except ProviderError as exc:
                # Failed, or unknown: let the client retry from scratch now
                # (safe, thanks to the reference) rather than after the lease.
                with pool.connection() as conn:
                    conn.execute(RELEASE, (scope, key, attempt))
                return error(502, f"payment provider: {exc}", **{"Retry-After": "1"})
            # 3. Record how far we got: whoever takes over resumes from here.
            with pool.connection() as conn:
                conn.execute(CHECKPOINT, (scope, key, f"charged {charge}", attempt))
        # 4. The local write and the completion in one transaction, fenced by
        #    `attempt`: if our lease ran out and a retry took the key over,
        #    idem_complete fails (22I03) and the payment insert rolls back.
        with pool.connection() as conn, conn.transaction():
            (payment_id,) = conn.execute(INSERT_PAYMENT, (user, request["amount"],
                                                          request["currency"], charge)).fetchone()
            answer = Response(201, {"id": payment_id, "amount": request["amount"],
                                    "currency": request["currency"], "charge": charge},
                              {"Location": f"/payments/{payment_id}"})
            conn.execute(COMPLETE, (scope, key, answer.status, answer.body,
                                    Jsonb(answer.headers), attempt))
        return answer
    except psycopg.DataError as exc:
        return lost_key(exc)
    # Any other exception leaves the claim in place, as a crash would: after
    # the lease a retry takes it over, from the last checkpoint.


def get_payment(user, payment_id):
    with pool.connection() as conn:
        row = conn.execute("""SELECT id, amount, currency, provider_charge AS charge
                              FROM payments WHERE id = %s AND user_name = %s""",
                           (payment_id, user)).fetchone()
    if row is None:
        return error(404, "no such payment")
    return Response(200, {k: v for k, v in row._asdict().items() if v is not None})


# -- HTTP plumbing -----------------------------------------------------------

ENDPOINTS = {"/payments": create_payment, "/charges": create_charge}


def parse_payment(raw):
    """Validated before any claim: a malformed request does not use up its key."""
    try:
        text = raw.decode()
        request = json.loads(text)
    except ValueError:  # UnicodeDecodeError included
        raise error(400, "the body must be JSON in UTF-8")
    if not (isinstance(request, dict) and type(request.get("amount")) is int
            and request["amount"] > 0 and isinstance(request.get("currency"), str)
            and re.fullmatch(r"[A-Z]{3}", request["currency"])):
        raise error(400, 'expected {"amount": <positive integer>, "currency": "EUR"}')
    return text, request


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        self.answer(self.post)

    def do_GET(self):
        self.answer(self.get)

    def post(self):
        endpoint = ENDPOINTS.get(self.path)
        if endpoint is None:
            raise error(404, "not found")
        length = self.headers.get("Content-Length", "0")
        if not length.isdigit() or int(length) > 65536:
            raise error(413, "Content-Length: at most 65536 bytes")
        raw = self.rfile.read(int(length))
        key = self.headers.get("Idempotency-Key")
        if not key:
            raise error(400, "Idempotency-Key header required")
        if len(key.encode()) > 255:
            raise error(400, "Idempotency-Key longer than 255 bytes")
        body, request = parse_payment(raw)
        return endpoint(self.user(), key, body, request)

    def get(self):
        match = re.fullmatch(r"/payments/(\d{1,18})", self.path)
        if match is None:
            raise error(404, "not found")
        return get_payment(self.user(), int(match[1]))

    def user(self):
        user = self.headers.get("X-User", "anonymous")
        if not re.fullmatch(r"[\w.@-]{1,64}", user):
            raise error(400, "X-User: 1 to 64 letters, digits or ._@-")
        return user

    def answer(self, handler):
        try:
            response = handler()
        except Response as early:
            response = early
        except psycopg.OperationalError as exc:  # database unreachable
            self.log_error("database: %s", exc)
            response = error(503, "database unavailable", **{"Retry-After": "1"})
        except Exception:
            traceback.print_exc()
            response = error(500, "internal error")
        payload = response.body.encode()
        self.send_response(response.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        for name, value in response.headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # socketserver's default, 5, resets a burst of connections


def main():
    with pool.connection() as conn:
        conn.execute(SCHEMA)
    if LEASE.total_seconds() <= PROVIDER_TIMEOUT:
        print(f"warning: IDEM_LEASE ({LEASE.total_seconds()}s) should exceed PROVIDER_TIMEOUT "
              f"({PROVIDER_TIMEOUT}s), or a slow provider call lets a retry take over a live request",
              file=sys.stderr)
    server = Server((os.environ.get("HOST", "127.0.0.1"), int(os.environ.get("PORT", "8000"))),
                    Handler)
    print("listening on http://%s:%d" % server.server_address[:2], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
