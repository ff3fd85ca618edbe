"""The two-transaction mode's pieces for the threaded adapters (Django, Flask).

``run(sql, params)`` is the adapter's way to run one statement in a
transaction of its own and return its row.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional

from ._protocol import CHECKPOINT, EXTEND_LEASE, Context, IdempotencyKeyLost, Options, is_lost_key

Run = Callable[[str, "tuple[Any, ...]"], Any]

log = logging.getLogger("pg_idempotency")


def checkpoint_with(run: Run, context: Context) -> Callable[[Optional[str]], None]:
    def checkpoint(recovery_point: Optional[str]) -> None:
        try:
            run(CHECKPOINT, (context.scope, context.key, recovery_point, context.attempt))
        except Exception as error:
            if is_lost_key(error):
                context.lost = True
                raise IdempotencyKeyLost(str(error)) from error
            raise

    return checkpoint


class Heartbeat(threading.Thread):
    """Calls idem_extend_lease every third of the lease, until stopped or lost.

    ``done`` runs in the thread when it ends (Django closes the thread's
    connection there).
    """

    def __init__(self, run: Run, context: Context, options: Options[Any],
                 done: Optional[Callable[[], None]] = None) -> None:
        super().__init__(name=f"idempotency heartbeat {context.key}", daemon=True)
        self.run_sql, self.context, self.options, self.done = run, context, options, done
        self.stopped = threading.Event()

    def run(self) -> None:
        try:
            while not self.stopped.wait(self.options.heartbeat_seconds()):
                try:
                    self.run_sql(EXTEND_LEASE, (self.context.scope, self.context.key,
                                                self.context.attempt, self.options.lease))
                except Exception as error:
                    if is_lost_key(error):
                        self.context.lost = True
                        return
                    log.warning("idempotency key %r: extending the lease failed: %s",
                                self.context.key, error)
        finally:
            if self.done is not None:
                self.done()

    def stop(self) -> None:
        self.stopped.set()
        self.join()
