#!/usr/bin/python3
"""End-to-end test of app.py over real HTTP, run by test.sh.

Needs the service (SERVICE_URL) and the provider stub (PROVIDER_URL) running,
the database in libpq's variables (PGHOST ...), and EXAMPLE_TMP, where the
instances this script starts itself (to kill them) keep their logs and pid
files. Standard library and psycopg only. Every check counts the effects
where they land: payments rows in the database, charges at the provider.
"""
import datetime
import email.utils
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
import uuid

import psycopg
from psycopg.rows import namedtuple_row

SERVICE = os.environ["SERVICE_URL"]
PROVIDER = os.environ["PROVIDER_URL"]
TMP = os.environ["EXAMPLE_TMP"]
APP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "app.py")
RUN = uuid.uuid4().hex[:8]  # keeps users and keys apart between runs by hand

db = psycopg.connect("", autocommit=True, prepare_threshold=None,  # pgbouncer-safe
                     row_factory=namedtuple_row)
passed = 0


def expect(condition, what):
    global passed
    if not condition:
        raise AssertionError(what)
    passed += 1
    print(f"    ok: {what}")


# -- HTTP --------------------------------------------------------------------

class Answer:
    def __init__(self, status, headers, body):
        self.status, self.headers, self.body = status, headers, body

    @property
    def replayed(self):
        return self.headers.get("Idempotent-Replayed") == "true"

    def json(self):
        return json.loads(self.body)

    def __repr__(self):
        return f"{self.status} {self.body[:200]!r}"


def http(method, url, body=None, headers=None, timeout=15):
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return Answer(response.status, response.headers, response.read())
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, exc.headers, exc.read())


def post(path, payment, key=None, user=None, base=SERVICE, timeout=15):
    body = payment if isinstance(payment, bytes) else json.dumps(payment).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    if user is not None:
        headers["X-User"] = user
    return http("POST", base + path, body, headers, timeout)


def retry_until_done(path, payment, key, user, base=SERVICE, patience=20):
    """What a well-behaved client does: retry while told 409, after Retry-After."""
    seen, deadline = [], time.monotonic() + patience
    while True:
        answer = post(path, payment, key, user, base)
        seen.append(answer.status)
        if answer.status != 409 or time.monotonic() > deadline:
            return answer, seen
        retry_after = answer.headers.get("Retry-After", "")
        expect(retry_after.isdigit() and int(retry_after) >= 1,
               f"a 409 carries Retry-After: whole seconds, at least 1 (got {retry_after!r})")
        time.sleep(int(retry_after))


def provider(user):
    """What the provider saw for one customer: (charges, requests)."""
    seen = http("GET", PROVIDER + "/charges").json()
    return ([c for c in seen["charges"] if c["customer"] == user],
            [r for r in seen["requests"] if r["customer"] == user])


def provider_control(**settings):
    answer = http("POST", PROVIDER + "/control", json.dumps(settings).encode())
    assert answer.status == 200, answer


# -- the database --------------------------------------------------------------

def payments(user):
    return db.execute("SELECT id, provider_charge FROM payments WHERE user_name = %s ORDER BY id",
                      (user,)).fetchall()


def key_row(scope, key):
    return db.execute("""SELECT attempt, recovery_point, status_code FROM idempotency.keys
                         WHERE scope = %s AND key = %s""", (scope, key)).fetchone()


def wait_for(condition, what, timeout=10):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class PaymentsLocked:
    """Holds a SHARE lock on payments in an open transaction, so a request
    that reaches its INSERT waits there, with its claim (and anything before
    it) done. Only this test uses it; the service has no hook of any kind."""

    def __enter__(self):
        self.conn = psycopg.connect("", prepare_threshold=None)
        self.conn.execute("LOCK TABLE payments IN SHARE MODE")
        return self

    @staticmethod
    def waiting():
        return db.execute("""SELECT count(*) FROM pg_locks
                             WHERE relation = 'payments'::regclass AND NOT granted""").fetchone()[0] > 0

    def __exit__(self, *exc):
        self.conn.rollback()
        self.conn.close()


def in_background(function, *args):
    """Run function(*args) in a thread; .result() is its answer or exception."""
    box = {}

    def run():
        try:
            box["answer"] = function(*args)
        except Exception as exc:
            box["answer"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    class Pending:
        @staticmethod
        def result(timeout=20):
            thread.join(timeout)
            return box.get("answer", TimeoutError("no answer yet"))
    return Pending


# -- instances of the service that the checks kill ------------------------------

class Instance:
    """An instance of app.py of this script's own: started, killed, restarted."""
    running = []

    def __init__(self, name, **env):
        self.name, self.env, self.port, self.process, self.starts = name, env, 0, None, 0

    def start(self):
        self.starts += 1
        log = os.path.join(TMP, f"{self.name}-{self.starts}.log")
        with open(log, "wb") as out:
            self.process = subprocess.Popen([sys.executable, APP], stdout=out, stderr=out,
                                            env=dict(os.environ, **self.env, PORT=str(self.port)))
        Instance.running.append(self)
        with open(os.path.join(TMP, f"{self.name}.pid"), "w") as pidfile:  # for test.sh's trap
            pidfile.write(str(self.process.pid))

        def listening():
            if self.process.poll() is not None:
                raise AssertionError(f"{self.name} exited: {open(log).read()}")
            with open(log) as text:
                return re.search(r"^listening on (http://\S+)\n", text.read(), re.M)
        wait_for(listening, f"{self.name} to listen")
        self.url = listening()[1]
        self.port = int(self.url.rsplit(":", 1)[1])  # a restart listens on the same port
        return self

    def kill(self):
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        os.unlink(os.path.join(TMP, f"{self.name}.pid"))
        Instance.running.remove(self)


# -- the checks ------------------------------------------------------------------

def check_no_key():
    """A POST without Idempotency-Key is refused before anything happens."""
    user = f"nokey-{RUN}"
    answer = post("/payments", {"amount": 100, "currency": "EUR"}, key=None, user=user)
    expect(answer.status == 400, f"no Idempotency-Key → 400 (got {answer})")
    expect(b"Idempotency-Key" in answer.body, "the error names the missing header")
    expect(payments(user) == [], "no payment was written")


def check_bad_input():
    """A malformed body is refused (400) before the claim: its key stays unused."""
    user, key = f"mallory-{RUN}", f"bad-{RUN}"
    for body in (b'{"amount": 100, "currency": "EUR"', b'{"amount": -5, "currency": "EUR"}',
                 b'{"amount": 100, "currency": "EUR", "note": "\\u0000"}'):
        answer = post("/payments", body, key, user)
        expect(answer.status == 400, f"{body.decode()} → 400 (got {answer})")
    expect(key_row(f"{user}:POST /payments", key) is None, "the key was not claimed")
    answer = post("/payments", {"amount": 100, "currency": "EUR"}, key, user)
    expect(answer.status == 201 and not answer.replayed, f"a valid request with that key → 201 (got {answer})")


def check_retry_replays():
    """A retried POST gets the stored response byte for byte, marked replayed."""
    user, key = f"alice-{RUN}", f"pay-{RUN}"
    first = post("/payments", {"amount": 1250, "currency": "EUR"}, key, user)
    expect(first.status == 201 and not first.replayed, f"first POST → 201, not replayed (got {first})")
    expect(first.headers["Location"] == f"/payments/{first.json()['id']}", "with Location")
    retry = post("/payments", {"amount": 1250, "currency": "EUR"}, key, user)
    expect(retry.status == 201, f"the retry → 201 (got {retry})")
    expect(retry.body == first.body, "the retry's body is identical, byte for byte")
    expect(retry.replayed, "the retry carries Idempotent-Replayed: true")
    expect("Idempotency-Expires" not in first.headers, "the first answer has no Idempotency-Expires")
    (expires_at,) = db.execute("SELECT expires_at FROM idempotency.keys WHERE scope = %s AND key = %s",
                               (f"{user}:POST /payments", key)).fetchone()
    expect(retry.headers.get("Idempotency-Expires")
           == email.utils.format_datetime(expires_at.astimezone(datetime.timezone.utc), usegmt=True),
           f"the replay's Idempotency-Expires is when the stored response expires, as an HTTP-date "
           f"(got {retry.headers.get('Idempotency-Expires')!r}, stored {expires_at})")
    expect(retry.headers["Location"] == first.headers["Location"], "and the stored Location header")
    same_json = post("/payments", b'{ "currency" : "EUR",\n  "amount" : 1250 }', key, user)
    expect(same_json.replayed and same_json.body == first.body,
           "the same JSON with other spacing and key order is the same request (replay)")
    expect(len(payments(user)) == 1, "exactly one payment row")
    fetched = http("GET", SERVICE + first.headers["Location"], headers={"X-User": user})
    expect(fetched.status == 200 and fetched.json()["id"] == first.json()["id"],
           "GET Location finds the payment")


def check_mismatch():
    """The same key with another body is refused, and changes nothing."""
    user, key = f"alice-{RUN}", f"pay-{RUN}"
    answer = post("/payments", {"amount": 9999, "currency": "EUR"}, key, user)
    expect(answer.status == 422, f"another body under the same key → 422 (got {answer})")
    expect(len(payments(user)) == 1, "still exactly one payment row")
    again = post("/payments", {"amount": 1250, "currency": "EUR"}, key, user)
    expect(again.replayed and again.json()["amount"] == 1250, "the original request still replays")


def check_scope_per_user():
    """Keys are scoped by X-User: another user's identical key is another request."""
    key = f"pay-{RUN}"
    answer = post("/payments", {"amount": 1250, "currency": "EUR"}, key, f"bob-{RUN}")
    expect(answer.status == 201 and not answer.replayed,
           f"bob's POST with alice's key → 201, not replayed (got {answer})")
    expect(len(payments(f"bob-{RUN}")) == 1 and len(payments(f"alice-{RUN}")) == 1,
           "one payment each for alice and bob")


def check_in_progress_never_waits():
    """A duplicate of a request still running gets 409 at once, not a wait."""
    user, key = f"carol-{RUN}", f"slow-{RUN}"
    payment = {"amount": 700, "currency": "EUR"}
    with PaymentsLocked() as lock:
        first = in_background(post, "/payments", payment, key, user)
        wait_for(lock.waiting, "the first request to reach its INSERT")
        started = time.monotonic()
        duplicate = post("/payments", payment, key, user)
        elapsed = time.monotonic() - started
        expect(duplicate.status == 409, f"a duplicate while the first runs → 409 (got {duplicate})")
        expect(duplicate.headers.get("Retry-After") == "1",
               "with Retry-After: 1 (the holder's transaction is open: no lease to count)")
        expect(elapsed < 2, f"answered at once ({elapsed:.3f} s), not after the first finished")
    first = first.result()
    expect(isinstance(first, Answer) and first.status == 201, f"the first then → 201 (got {first})")
    retry = post("/payments", payment, key, user)
    expect(retry.replayed and retry.body == first.body, "a retry now replays it")
    expect(len(payments(user)) == 1, "exactly one payment row")


def check_retry_after_counts_the_lease():
    """A duplicate of a two-transaction request gets 409 with Retry-After
    counting down the holder's lease, rounded up."""
    user, key = f"frank-{RUN}", f"leased-{RUN}"
    payment = {"amount": 300, "currency": "EUR"}
    scope = f"{user}:POST /charges"
    # another request holds the key: its claim committed, with a 10 s lease
    db.execute("""SELECT idempotency.idem_claim(%s, %s, idempotency.idem_fingerprint(%s::jsonb),
                                                lease => '10 s')""",
               (scope, key, json.dumps(payment)))
    duplicate = post("/charges", payment, key, user)
    (left,) = db.execute("""SELECT extract(epoch FROM lease_expires_at - clock_timestamp())
                            FROM idempotency.keys WHERE scope = %s AND key = %s""",
                         (scope, key)).fetchone()
    expect(duplicate.status == 409, f"a duplicate while the holder's lease runs → 409 (got {duplicate})")
    retry_after = duplicate.headers.get("Retry-After", "")
    expect(retry_after.isdigit() and math.ceil(left) <= int(retry_after) <= 10,
           f"Retry-After is the lease's seconds left, rounded up (got {retry_after!r}, {left:.3f} s left)")
    extended = db.execute("SELECT idempotency.idem_extend_lease(%s, %s, 1, '1 hour')",
                          (scope, key)).fetchone()
    expect(extended is not None, "the holder extends its lease to an hour")
    later = post("/charges", payment, key, user)
    expect(later.status == 409 and 3590 <= int(later.headers["Retry-After"]) <= 3600,
           f"then Retry-After says an hour (got {later.status} {later.headers.get('Retry-After')})")
    db.execute("SELECT idempotency.idem_release(%s, %s, 1)", (scope, key))


def check_concurrent_duplicates():
    """20 identical requests at the same instant create one payment."""
    user, key, n = f"dave-{RUN}", f"burst-{RUN}", 20
    payment = {"amount": 4200, "currency": "EUR"}
    barrier, answers = threading.Barrier(n), [None] * n

    def one(i):
        barrier.wait()
        try:
            answers[i] = post("/payments", payment, key, user)
        except Exception as exc:
            answers[i] = exc
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    expect(all(isinstance(a, Answer) for a in answers),
           f"every request got an HTTP answer {[a for a in answers if not isinstance(a, Answer)]}")
    kinds = {}
    for a in answers:
        kind = f"{a.status}{' replayed' if a.replayed else ''}"
        kinds[kind] = kinds.get(kind, 0) + 1
    print(f"    ({n} answers: {kinds})")
    expect(all(a.status in (201, 409) for a in answers), "every answer is 201 or 409")
    created = [a for a in answers if a.status == 201 and not a.replayed]
    expect(len(created) == 1, "exactly one answer ran the request (201, not replayed)")
    expect(all(a.body == created[0].body for a in answers if a.status == 201),
           "every 201 has the same body")
    expect(len(payments(user)) == 1, "exactly one payment row")
    final = post("/payments", payment, key, user)
    expect(final.replayed and final.body == created[0].body, "a later retry replays it")


def check_crash_in_one_transaction():
    """The service dies in the middle of a one-transaction request: nothing
    was stored, not even the claim, so the retry runs at once."""
    user, key = f"ivan-{RUN}", f"pay-{RUN}"
    payment = {"amount": 800, "currency": "EUR"}
    victim = Instance("crash-payment").start()
    with PaymentsLocked() as lock:
        doomed = in_background(post, "/payments", payment, key, user, victim.url)
        wait_for(lock.waiting, "the request to reach its INSERT, its claim made")
        victim.kill()
        outcome = doomed.result()
        expect(isinstance(outcome, OSError), f"the client got no answer, the service died ({outcome!r})")
    # its server session rolls back when it notices the client is gone
    wait_for(lambda: not db.execute("""SELECT 1 FROM pg_locks WHERE relation = 'payments'::regclass
                                       AND pid <> pg_backend_pid()""").fetchone(),
             "the dead request's transaction to end")
    expect(key_row(f"{user}:POST /payments", key) is None and payments(user) == [],
           "no claim and no payment are left")
    retry = post("/payments", payment, key, user)
    expect(retry.status == 201 and not retry.replayed,
           f"the first retry runs the request → 201, no 409 (got {retry})")
    expect(len(payments(user)) == 1, "exactly one payment row")


def check_slow_owner_is_fenced():
    """An owner that is slow rather than dead: a retry takes its key over
    after its lease, and the slow one, fenced by its attempt number, stops
    with 409 instead of recording anything."""
    user, key = f"judy-{RUN}", f"charge-{RUN}"
    scope, payment = f"{user}:POST /charges", {"amount": 3400, "currency": "EUR"}
    # this instance waits for the provider far longer than its lease
    slow = Instance("slow", IDEM_LEASE="1", PROVIDER_TIMEOUT="20").start()
    provider_control(hang=1)
    try:
        stalled = in_background(post, "/charges", payment, key, user, slow.url, 30)
        wait_for(lambda: provider(user)[0], "the provider to charge")
        with PaymentsLocked() as lock:  # keeps the takeover in progress
            retry = in_background(retry_until_done, "/charges", payment, key, user)
            wait_for(lambda: lock.waiting() and key_row(scope, key).attempt == 2,
                     "the retry to take the key over and reach its INSERT")
            provider_control(release=True)  # the slow owner wakes up
            stale = stalled.result()
            expect(isinstance(stale, Answer) and stale.status == 409 and b"taken over" in stale.body,
                   f"the slow owner's checkpoint is refused (22I03) → 409 (got {stale})")
        retry, seen = retry.result()
    finally:
        provider_control(release=True)
    expect(retry.status == 201 and not retry.replayed, f"the retry completes → 201 (got {retry})")
    charges, _ = provider(user)
    expect(len(charges) == 1 and retry.json()["charge"] == charges[0]["id"],
           "exactly one charge at the provider, the one answered")
    expect(key_row(scope, key).attempt == 2 and len(payments(user)) == 1,
           "exactly one payment row, recorded by attempt 2")


def check_provider_failure():
    """The provider fails: 502, the key is released, the retry charges once."""
    user, key = f"erin-{RUN}", f"charge-{RUN}"
    payment = {"amount": 3000, "currency": "EUR"}
    provider_control(fail=1)
    failed = post("/charges", payment, key, user)
    expect(failed.status == 502, f"provider down → 502 (got {failed})")
    expect(provider(user)[0] == [] and payments(user) == [], "nothing charged, no payment")
    expect(key_row(f"{user}:POST /charges", key) is None, "the key was released (no row)")
    retry = post("/charges", payment, key, user)
    expect(retry.status == 201 and not retry.replayed, f"the retry → 201 (got {retry})")
    charges, _ = provider(user)
    expect(len(charges) == 1 and retry.json()["charge"] == charges[0]["id"],
           "one charge at the provider, the one answered")
    expect(len(payments(user)) == 1, "exactly one payment row")
    again = post("/charges", payment, key, user)
    expect(again.replayed and again.body == retry.body, "a later retry replays it")


def check_provider_timeout():
    """The provider charges but answers too late: 502, and the retry's call,
    under the same reference, gets that charge back instead of a second one."""
    user, key = f"frank-{RUN}", f"charge-{RUN}"
    payment = {"amount": 3100, "currency": "EUR"}
    provider_control(hang=1)
    try:
        late = post("/charges", payment, key, user)
    finally:
        provider_control(release=True)
    expect(late.status == 502 and b"timed out" in late.body, f"provider timeout → 502 (got {late})")
    expect(len(provider(user)[0]) == 1, "the provider did charge (its answer was lost)")
    retry = post("/charges", payment, key, user)
    expect(retry.status == 201 and not retry.replayed, f"the retry → 201 (got {retry})")
    charges, requests = provider(user)
    expect(len(charges) == 1 and retry.json()["charge"] == charges[0]["id"],
           "still one charge at the provider, the one answered")
    expect([r["status"] for r in requests] == [201, 200],
           "the provider saw the reference twice and answered the retry from its own record")
    expect(len(payments(user)) == 1, "exactly one payment row")


def check_crash_during_provider_call():
    """The service dies while the provider holds the charged answer; the
    restarted service takes the claim over once the lease runs out."""
    user, key = f"grace-{RUN}", f"charge-{RUN}"
    scope, payment = f"{user}:POST /charges", {"amount": 3200, "currency": "EUR"}
    victim = Instance("crash-provider").start()
    provider_control(hang=1)
    try:
        doomed = in_background(post, "/charges", payment, key, user, victim.url)
        wait_for(lambda: provider(user)[0], "the provider to charge")
        victim.kill()
        outcome = doomed.result()
        expect(isinstance(outcome, OSError), f"the client got no answer, the service died ({outcome!r})")
    finally:
        provider_control(release=True)
    expect(key_row(scope, key)[0:2] == (1, None), "attempt 1's claim is left, with no checkpoint")
    victim.start()
    retry, seen = retry_until_done("/charges", payment, key, user, victim.url)
    print(f"    (the retry saw {seen})")
    expect(retry.status == 201 and not retry.replayed, f"the retry completes → 201 (got {retry})")
    expect(key_row(scope, key)[0] == 2, "by taking the key over: attempt 2")
    charges, requests = provider(user)
    expect(len(charges) == 1 and retry.json()["charge"] == charges[0]["id"],
           "exactly one charge at the provider, the one answered")
    expect([r["status"] for r in requests] == [201, 200],
           "attempt 2 called again with the same reference and got the same charge")
    expect([p.provider_charge for p in payments(user)] == [charges[0]["id"]], "exactly one payment row")
    again = post("/charges", payment, key, user)
    expect(again.replayed and again.body == retry.body, "a later retry replays it")


def check_crash_after_checkpoint():
    """The service dies after its checkpoint ("charged ch_N"), before
    recording the payment; another instance resumes without calling the
    provider again."""
    user, key = f"heidi-{RUN}", f"charge-{RUN}"
    scope, payment = f"{user}:POST /charges", {"amount": 3300, "currency": "EUR"}
    victim = Instance("crash-checkpoint").start()
    with PaymentsLocked() as lock:
        doomed = in_background(post, "/charges", payment, key, user, victim.url)
        wait_for(lambda: lock.waiting() and (key_row(scope, key) or [0, None])[1],
                 "the checkpoint, and the payment INSERT waiting")
        victim.kill()
        outcome = doomed.result()
        expect(isinstance(outcome, OSError), f"the client got no answer, the service died ({outcome!r})")
    charges, _ = provider(user)
    expect(len(charges) == 1, "the provider charged")
    expect(key_row(scope, key)[0:2] == (1, f"charged {charges[0]['id']}"),
           "attempt 1 left its checkpoint: charged " + charges[0]["id"])
    expect(payments(user) == [], "and no payment (its transaction died with it)")
    retry, seen = retry_until_done("/charges", payment, key, user, SERVICE)
    print(f"    (the retry, on the other instance, saw {seen})")
    expect(retry.status == 201 and not retry.replayed, f"the retry completes → 201 (got {retry})")
    expect(key_row(scope, key)[0] == 2, "by taking the key over: attempt 2")
    charges, requests = provider(user)
    expect(len(requests) == 1 and len(charges) == 1,
           "the provider was not called again: one request, one charge")
    expect(retry.json()["charge"] == charges[0]["id"], "the answer names that charge")
    expect([p.provider_charge for p in payments(user)] == [charges[0]["id"]], "exactly one payment row")


def main():
    checks = [check_no_key, check_bad_input, check_retry_replays, check_mismatch, check_scope_per_user,
              check_in_progress_never_waits, check_retry_after_counts_the_lease,
              check_concurrent_duplicates,
              check_crash_in_one_transaction, check_provider_failure, check_provider_timeout,
              check_crash_during_provider_call, check_crash_after_checkpoint,
              check_slow_owner_is_fenced]
    failed = 0
    started = time.monotonic()
    try:
        for check in checks:
            print(f"- {' '.join(check.__doc__.split())}  [{check.__name__}]")
            try:
                check()
            except Exception:
                failed += 1
                print("    FAILED:")
                traceback.print_exc(file=sys.stdout)
    finally:
        for instance in list(Instance.running):
            instance.kill()
    print(f"{len(checks) - failed} passed, {failed} failed  "
          f"({passed} assertions, {time.monotonic() - started:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
