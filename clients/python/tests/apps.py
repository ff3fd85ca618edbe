"""One small app per adapter, with the same routes, for the package's tests.

  POST /orders   one transaction: inserts a row on the middleware's connection
  POST /binary   answers 1 KiB of every byte value (stored in base64)
  POST /boom     inserts a row, then raises: a 500, rolled back
  POST /slow     two transactions: checkpoints "started", waits for GATE,
                 checkpoints "finishing", answers its attempt and the
                 recovery point it was given

"Authorization: Bearer NAME" is the principal of each (Starlette's
request.user, Django's request.user.pk, Flask's g.user). Options: a wait of
0.2 s, a lease of 1.2 s (a heartbeat every 0.4 s).
"""
import asyncio
import contextlib
import getpass
import json
import os
import threading

GATE = threading.Event()
BINARY = bytes(range(256)) * 4
OPTIONS = {"wait": 0.2, "lease": 1.2, "required": True}
INSERT = "INSERT INTO orders (sku, qty) VALUES (%s, %s) RETURNING id"


def slow_mode(request):
    return "two_transaction" if request.path.endswith("/slow") else "one_transaction"


def starlette_app(pool, **options):
    from starlette.applications import Starlette
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

    async def slow(request):
        context = request.state.idempotency
        await context.checkpoint("started")
        await asyncio.to_thread(GATE.wait, 30)
        await context.checkpoint("finishing")
        return JSONResponse({"attempt": context.attempt,
                             "recovery_point": context.recovery_point})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await pool.open(wait=True)
        yield
        await pool.close()

    options = {**OPTIONS, "mode": lambda r: slow_mode(r.url), **options}
    return Starlette(
        routes=[Route(path, handler, methods=["POST"]) for path, handler in
                (("/orders", orders), ("/binary", binary), ("/boom", boom), ("/slow", slow))],
        middleware=[Middleware(AuthenticationMiddleware, backend=Bearer()),
                    Middleware(IdempotencyMiddleware, pool=pool, **options)],
        lifespan=lifespan)


def flask_app(pool):
    from flask import Flask, Response, g, jsonify, request

    from pg_idempotency.flask import Idempotency

    app = Flask(__name__)

    @app.before_request
    def authenticate():
        scheme, _, name = request.headers.get("Authorization", "").partition(" ")
        g.user = name if scheme.lower() == "bearer" and name else None

    Idempotency(app, pool=pool, mode=slow_mode, **OPTIONS)

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

    @app.post("/slow")
    def slow():
        g.idempotency.checkpoint("started")
        GATE.wait(30)
        g.idempotency.checkpoint("finishing")
        return jsonify(attempt=g.idempotency.attempt,
                       recovery_point=g.idempotency.recovery_point)

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

    def slow(request):
        request.idempotency.checkpoint("started")
        GATE.wait(30)
        request.idempotency.checkpoint("finishing")
        return JsonResponse({"attempt": request.idempotency.attempt,
                             "recovery_point": request.idempotency.recovery_point})

    return [path("orders", orders), path("binary", binary), path("boom", boom),
            path("slow", slow)]


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
