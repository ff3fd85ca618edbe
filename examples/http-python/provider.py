#!/usr/bin/python3
"""A stub payment provider for app.py's POST /charges, in memory.

Like a real one, it honours an idempotency reference: a charge request with
a reference it has seen returns that charge (200) instead of charging again.
It counts every request and every charge, so a test can check "exactly once"
on the provider's side, and it can be told to misbehave:

  POST /charges   {"reference", "customer", "amount", "currency"}
                  → 201 {"id": "ch_1", ...}: charged
                  → 200 the same charge: a repeated reference
                  → 409: a repeated reference with other details
                  → 503: told to fail (nothing charged)
  POST /control   {"fail": n}     the next n charge requests fail with 503
                  {"hang": n}     the next n new charges are recorded, then
                                  the answer waits (up to 60 s) for a release
                  {"release": true}  answer the requests that hang
  GET  /charges   {"charges": [...], "requests": [...]}: what happened

HOST and PORT (127.0.0.1:8001; PORT=0 picks a free port) say where to listen.
"""
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

lock = threading.Lock()
charges = {}  # reference -> charge
requests = []  # every charge request: reference, customer, answer status
control = {"fail": 0, "hang": 0}
released = threading.Event()


def charge(request):
    """Returns (status, body, event): an event to wait for when told to hang."""
    fields = {k: request.get(k) for k in ("reference", "customer", "amount", "currency")}
    with lock:
        log = dict(fields, status=None)
        requests.append(log)
        if control["fail"] > 0:
            control["fail"] -= 1
            log["status"] = 503
            return 503, {"error": "provider unavailable (told to fail)"}, None
        existing = charges.get(fields["reference"])
        if existing is not None:
            same = all(existing[k] == v for k, v in fields.items())
            log["status"] = 200 if same else 409
            return (200, existing, None) if same else (409, {"error": "reference reused"}, None)
        new = dict(fields, id=f"ch_{len(charges) + 1}")
        charges[fields["reference"]] = new
        log["status"] = 201
        if control["hang"] > 0:
            control["hang"] -= 1
            return 201, new, released
        return 201, new, None


def set_control(body):
    global released
    with lock:
        for name in ("fail", "hang"):
            control[name] = int(body.get(name, control[name]))
        if body.get("release"):
            released.set()
            released = threading.Event()
        return dict(control)


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path != "/charges":
            return self.reply(404, {"error": "not found"})
        with lock:
            seen = {"charges": list(charges.values()), "requests": [dict(r) for r in requests]}
        self.reply(200, seen)

    def do_POST(self):
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        except ValueError:
            return self.reply(400, {"error": "bad JSON"})
        if self.path == "/charges":
            status, answer, hang = charge(body)
            if hang:  # charged, but the answer is late: the caller may give up or die
                hang.wait(60)
            self.reply(status, answer)
        elif self.path == "/control":
            self.reply(200, set_control(body))
        else:
            self.reply(404, {"error": "not found"})

    def reply(self, status, body):
        payload = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except OSError:  # the caller went away (it timed out or was killed)
            pass


if __name__ == "__main__":
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer.request_queue_size = 128
    server = ThreadingHTTPServer((os.environ.get("HOST", "127.0.0.1"),
                                  int(os.environ.get("PORT", "8001"))), Handler)
    print("listening on http://%s:%d" % server.server_address[:2], flush=True)
    server.serve_forever()
