"""Idempotency-Key middleware and consumer dedup on the ``idempotency`` extension.

- ``pg_idempotency.asgi.IdempotencyMiddleware``: Starlette and FastAPI
- ``pg_idempotency.django.IdempotencyMiddleware``: Django's MIDDLEWARE
- ``pg_idempotency.flask.Idempotency``: a Flask extension
- ``dedup`` and ``dedup_batch``: message consumers

The protocol is the project's doc/http.md.
"""
from ._protocol import IdempotencyKeyLost, Options
from .consumer import dedup, dedup_batch

__all__ = ["IdempotencyKeyLost", "Options", "dedup", "dedup_batch"]
__version__ = "1.1.0"
