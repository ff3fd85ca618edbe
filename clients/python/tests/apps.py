"""One small app per adapter, with the same routes, for the package's tests.

  POST /orders   one transaction: inserts a row on the middleware's connection
  POST /binary   answers 1 KiB of every byte value (stored in base64)
  POST /boom     inserts a row, then raises: a 500, rolled back
  POST /too-large  inserts a row, lowers idempotency.max_response_bytes to
                 1kB for its transaction (SET LOCAL), answers 201 with BIG
  POST /slow     two transactions: checkpoints "started", waits for GATE,
                 checkpoints "finishing", answers its attempt and the
                 recovery point it was given
  POST /slow-boom  two transactions: checkpoints "started", then raises
  POST /sql-error  a statement that fails in the claim's transaction
  POST /echo     (Starlette) the body back; 400 if it is not JSON
  POST /policy   (Starlette, Flask) inserts a row, sets idempotency.release_statuses
                 to the body's "policy" for its transaction, answers the
                 body's "status"
  POST /file     (Flask) send_file of BINARY: a direct-passthrough response
  POST /vary     (Starlette, Flask) a response with two Vary headers
  POST /background  (Starlette) /orders with a background task (BACKGROUND_*)
  POST /unfinished, /slow-unfinished  (Starlette) a raw ASGI endpoint that
                 inserts (one transaction) and returns mid-response
  POST /async-orders  (Django) /orders as an async view; X-Fail-Status: S
                 answers S after the insert

"Authorization: Bearer NAME" is the principal of each (Starlette's
request.user, Django's request.user.pk, Flask's g.user). Options: a wait of
0.2 s, a lease of 1.2 s (a heartbeat every 0.4 s).
"""
import asyncio
import contextlib
import getpass
import io
import json
import os
import threading

GATE = threading.Event()
# /background's task: waits for BACKGROUND_GATE, then counts its row from a
# connection of its own into BACKGROUND_SAW
BACKGROUND_GATE, BACKGROUND_SAW = threading.Event(), []
BINARY = bytes(range(256)) * 4
OPTIONS = {"wait": 0.2, "lease": 1.2, "required": True}
POOL_KWARGS = {"autocommit": True, "prepare_threshold": None}
INSERT = "INSERT INTO orders (sku, qty) VALUES (%s, %s) RETURNING id"
SET_LIMIT = "SET LOCAL idempotency.max_response_bytes = '1kB'"  # PGC_SUSET: PGUSER's a superuser
BIG = b"x" * 2048


def slow_mode(request):
    two = request.path.endswith(("/slow", "/slow-boom", "/slow-unfinished"))
    return "two_transaction" if two else "one_transaction"


def starlette_app(pool, **options):
    import psycopg
    from starlette.applications import Starlette
    from starlette.background import BackgroundTask
    from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
    from starlette.middleware import Middleware
    from starlette.middleware.authentication import AuthenticationMiddleware
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from pg_idempotency.asgi import IdempotencyMiddleware

    class Bearer(AuthenticationBackend):
        async def authenticate(self, conn):
            scheme, _, name = conn.headers.get("authorization", "").partition(" ")
            if scheme.lower() == "bearer" and name:
                return AuthCredentials(["authenticated"]), SimpleUser(name)
            return None

    async def orders(request):
        body = await request.json()
        cursor = await request.state.idempotency.conn.execute(INSERT, (body["sku"], body["qty"]))
        return JSONResponse({"id": (await cursor.fetchone())[0]}, status_code=201)

    async def binary(request):
        return Response(BINARY, media_type="application/octet-stream")

    async def boom(request):
        body = await request.json()
        await request.state.idempotency.conn.execute(INSERT, (body["sku"], body["qty"]))
        raise RuntimeError("boom")

    async def too_large(request):
        body = await request.json()
        await request.state.idempotency.conn.execute(INSERT, (body["sku"], body["qty"]))
        await request.state.idempotency.conn.execute(SET_LIMIT)
        return Response(BIG, status_code=201, media_type="text/plain")

    async def slow(request):
        context = request.state.idempotency
        await context.checkpoint("started")
        await asyncio.to_thread(GATE.wait, 30)
        await context.checkpoint("finishing")
        return JSONResponse({"attempt": context.attempt,
                             "recovery_point": context.recovery_point})

    async def slow_boom(request):
        await request.state.idempotency.checkpoint("started")
        raise RuntimeError("slow boom")

    async def sql_error(request):
        await request.state.idempotency.conn.execute("SELECT 1/0")

    async def background(request):
        body = await request.json()
        await request.state.idempotency.conn.execute(INSERT, (body["sku"], body["qty"]))

        async def count_the_row():
            await asyncio.to_thread(BACKGROUND_GATE.wait, 10)
            async with await psycopg.AsyncConnection.connect("", **POOL_KWARGS) as own:
                cursor = await own.execute("SELECT count(*) FROM orders WHERE sku = %s",
                                           (body["sku"],))
                BACKGROUND_SAW.append((await cursor.fetchone())[0])

        return JSONResponse({"sku": body["sku"]}, status_code=201,
                            background=BackgroundTask(count_the_row))

    class Unfinished:  # a raw ASGI endpoint
        async def __call__(self, scope, receive, send):
            conn = scope["state"]["idempotency"].conn
            if conn is not None:
                key = dict(scope["headers"])[b"idempotency-key"].decode()
                await conn.execute(INSERT, (key, 1))  # the key as its sku
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"the beginning",
                        "more_body": True})

    async def policy(request):
        body = await request.json()
        conn = request.state.idempotency.conn
        await conn.execute(INSERT, (body["sku"], body["qty"]))
        await conn.execute("SELECT set_config('idempotency.release_statuses', %s, true)",
                           (body["policy"],))
        return JSONResponse({"sku": body["sku"]}, status_code=body["status"])

    async def vary(request):
        response = Response(b"two Vary headers", media_type="text/plain; charset=utf-8")
        response.raw_headers += [(b"vary", b"Accept"), (b"vary", b"Authorization")]
        return response

    async def echo(request):
        try:
            return JSONResponse(json.loads(await request.body()))
        except ValueError:
            return Response(b"not JSON", status_code=400)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await pool.open(wait=True)
        yield
        await pool.close()

    options = {**OPTIONS, "mode": lambda r: slow_mode(r.url), **options}
    return Starlette(
        routes=[Route(path, handler, methods=["POST"]) for path, handler in
                (("/orders", orders), ("/binary", binary), ("/boom", boom), ("/slow", slow),
                 ("/too-large", too_large),
                 ("/slow-boom", slow_boom), ("/sql-error", sql_error), ("/echo", echo),
                 ("/vary", vary), ("/background", background), ("/policy", policy))] +
               [Route(path, Unfinished()) for path in ("/unfinished", "/slow-unfinished")],
        middleware=[Middleware(AuthenticationMiddleware, backend=Bearer()),
                    Middleware(IdempotencyMiddleware, pool=pool, **options)],
        lifespan=lifespan)


def flask_app(pool):
    from flask import Flask, Response, g, jsonify, request, send_file

    from pg_idempotency.flask import Idempotency

    app = Flask(__name__)

    @app.before_request
    def authenticate():
        scheme, _, name = request.headers.get("Authorization", "").partition(" ")
        g.user = name if scheme.lower() == "bearer" and name else None

    # the app factory's way (examples/flask has Idempotency(app, ...))
    Idempotency(pool=pool, mode=slow_mode, **OPTIONS).init_app(app)

    @app.post("/orders")
    def orders():
        body = request.get_json()
        (order_id,) = g.idempotency.conn.execute(INSERT, (body["sku"], body["qty"])).fetchone()
        return jsonify(id=order_id), 201

    @app.post("/binary")
    def binary():
        return Response(BINARY, mimetype="application/octet-stream")

    @app.post("/boom")
    def boom():
        body = request.get_json()
        g.idempotency.conn.execute(INSERT, (body["sku"], body["qty"]))
        raise RuntimeError("boom")

    @app.post("/too-large")
    def too_large():
        body = request.get_json()
        g.idempotency.conn.execute(INSERT, (body["sku"], body["qty"]))
        g.idempotency.conn.execute(SET_LIMIT)
        return Response(BIG, status=201, mimetype="text/plain")

    @app.post("/slow")
    def slow():
        g.idempotency.checkpoint("started")
        GATE.wait(30)
        g.idempotency.checkpoint("finishing")
        return jsonify(attempt=g.idempotency.attempt,
                       recovery_point=g.idempotency.recovery_point)

    @app.post("/slow-boom")
    def slow_boom():
        g.idempotency.checkpoint("started")
        raise RuntimeError("slow boom")

    @app.post("/sql-error")
    def sql_error():
        g.idempotency.conn.execute("SELECT 1/0")

    @app.post("/vary")
    def vary():
        return Response("two Vary headers", mimetype="text/plain",
                        headers=[("Vary", "Accept"), ("Vary", "Authorization")])

    @app.post("/file")
    def file():
        return send_file(io.BytesIO(BINARY), mimetype="application/octet-stream")

    @app.post("/policy")
    def policy():
        body = request.get_json()
        conn = g.idempotency.conn
        conn.execute(INSERT, (body["sku"], body["qty"]))
        conn.execute("SELECT set_config('idempotency.release_statuses', %s, true)",
                     (body["policy"],))
        return jsonify(sku=body["sku"]), body["status"]

    return app


# Django: this module is the URLconf, and these are its middleware and views
class DjangoUser:
    is_authenticated = True

    def __init__(self, name):
        self.pk = name


def django_bearer(get_response):
    def middleware(request):
        scheme, _, name = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and name:
            request.user = DjangoUser(name)
        return get_response(request)
    return middleware


def django_views():
    from asgiref.sync import sync_to_async
    from django.db import connection
    from django.http import HttpResponse, JsonResponse
    from django.urls import path

    def orders(request):
        body = json.loads(request.body)
        with connection.cursor() as cursor:
            cursor.execute(INSERT, [body["sku"], body["qty"]])
            return JsonResponse({"id": cursor.fetchone()[0]}, status=201)

    def binary(request):
        return HttpResponse(BINARY, content_type="application/octet-stream")

    def boom(request):
        body = json.loads(request.body)
        with connection.cursor() as cursor:
            cursor.execute(INSERT, [body["sku"], body["qty"]])
        raise RuntimeError("boom")

    def too_large(request):
        body = json.loads(request.body)
        with connection.cursor() as cursor:
            cursor.execute(INSERT, [body["sku"], body["qty"]])
            cursor.execute(SET_LIMIT)
        return HttpResponse(BIG, status=201, content_type="text/plain")

    def slow(request):
        request.idempotency.checkpoint("started")
        GATE.wait(30)
        request.idempotency.checkpoint("finishing")
        return JsonResponse({"attempt": request.idempotency.attempt,
                             "recovery_point": request.idempotency.recovery_point})

    async def async_orders(request):  # under ASGI: the ORM's thread is the middleware's
        body = json.loads(request.body)

        def insert():
            with connection.cursor() as cursor:
                cursor.execute(INSERT, [body["sku"], body["qty"]])
                return cursor.fetchone()[0]

        order_id = await sync_to_async(insert)()
        status = int(request.headers.get("X-Fail-Status", "201"))
        return JsonResponse({"id": order_id}, status=status)

    def slow_boom(request):
        request.idempotency.checkpoint("started")
        raise RuntimeError("slow boom")

    def sql_error(request):
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1/0")

    return [path("orders", orders), path("binary", binary), path("boom", boom),
            path("too-large", too_large),
            path("slow", slow), path("slow-boom", slow_boom), path("sql-error", sql_error),
            path("async-orders", async_orders)]


def django_app():
    import django
    from django.conf import settings
    from django.core.wsgi import get_wsgi_application

    if not settings.configured:
        settings.configure(
            DEBUG=False, ALLOWED_HOSTS=["127.0.0.1"], ROOT_URLCONF=__name__,
            SECRET_KEY="tests", USE_TZ=True, TIME_ZONE="UTC",
            MIDDLEWARE=[f"{__name__}.django_bearer",
                        "pg_idempotency.django.IdempotencyMiddleware"],
            IDEMPOTENCY={**OPTIONS, "mode": f"{__name__}.slow_mode"},
            DATABASES={"default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": os.environ.get("PGDATABASE") or os.environ.get("PGUSER")
                or getpass.getuser()}},
            LOGGING_CONFIG=None)  # the 500 of /boom is expected: no traceback
        django.setup()
    return get_wsgi_application()


def __getattr__(name):
    if name == "urlpatterns":  # Django's URLconf, built once Django is set up
        return django_views()
    raise AttributeError(name)
