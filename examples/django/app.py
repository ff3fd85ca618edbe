"""POST /orders behind the Idempotency-Key middleware, with Django.

One file: the settings, the URL and the view. Run it with ./serve PORT
(gunicorn); the database is libpq's environment variables (PGHOST, PGPORT,
PGUSER, PGDATABASE). A key is required; the view's insert and the key's
answer commit in one transaction (the middleware's transaction.atomic()).

  IDEM_MIDDLEWARE=off   the same view without the middleware
  IDEM_TEST_HOOKS=1     obey X-Delay-Ms, X-Fail-Status and X-Crash (tests only)

"Authorization: Bearer NAME" stands in for real authentication (Django's
AuthenticationMiddleware and its tables): BearerUser sets request.user,
whose pk the default scope of the keys includes.
"""
import getpass
import json
import os
import signal

import django
from django.conf import settings

MIDDLEWARE = os.environ.get("IDEM_MIDDLEWARE", "on") != "off"
HOOKS = os.environ.get("IDEM_TEST_HOOKS") == "1"

settings.configure(
    DEBUG=False,
    ALLOWED_HOSTS=["127.0.0.1", "localhost"],
    ROOT_URLCONF=__name__,
    SECRET_KEY="an example without sessions or signing",
    USE_TZ=True,
    TIME_ZONE="UTC",
    MIDDLEWARE=[f"{__name__}.BearerUser"] +
    (["pg_idempotency.django.IdempotencyMiddleware"] if MIDDLEWARE else []),
    IDEMPOTENCY={"required": True},
    DATABASES={"default": {
        # empty HOST, PORT and USER: libpq reads PGHOST, PGPORT and PGUSER
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("PGDATABASE") or os.environ.get("PGUSER") or getpass.getuser(),
        "CONN_MAX_AGE": 60,
    }},
)
django.setup()

from django.core.wsgi import get_wsgi_application  # noqa: E402 (after setup)
from django.db import connection  # noqa: E402
from django.http import JsonResponse  # noqa: E402
from django.urls import path  # noqa: E402
from django.views.decorators.http import require_POST  # noqa: E402


class User:
    is_authenticated = True

    def __init__(self, name):
        self.pk = name


class BearerUser:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        scheme, _, name = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and name:
            request.user = User(name)
        return self.get_response(request)


@require_POST
def create_order(request):
    if HOOKS and "X-Fail-Status" in request.headers:
        return JsonResponse({"error": "failing as asked"},
                            status=int(request.headers["X-Fail-Status"]))
    order = json.loads(request.body)
    # with the middleware, inside its transaction.atomic(); without, autocommit
    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO orders (sku, qty) VALUES (%s, %s) RETURNING id",
                       [order["sku"], order["qty"]])
        (order_id,) = cursor.fetchone()
        if HOOKS and "X-Delay-Ms" in request.headers:
            # in the database, so that a test sees the request at work there
            cursor.execute("SELECT pg_sleep(%s)", [int(request.headers["X-Delay-Ms"]) / 1000])
    if HOOKS and request.headers.get("X-Crash") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    response = JsonResponse({"id": order_id, "sku": order["sku"], "qty": order["qty"]},
                            status=201)
    response["Location"] = f"/orders/{order_id}"
    return response


urlpatterns = [path("orders", create_order)]

with connection.cursor() as cursor:
    cursor.execute("""CREATE TABLE IF NOT EXISTS orders (
        id bigserial PRIMARY KEY, sku text NOT NULL, qty integer NOT NULL)""")
connection.close()  # the threads open their own

application = get_wsgi_application()
