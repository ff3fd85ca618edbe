/*-------------------------------------------------------------------------
 *
 * worker_xact.h
 *	  The background workers' own transactions: one unit of work each.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_WORKER_XACT_H
#define IDEMPOTENCY_WORKER_XACT_H

/* How a unit of work runs (worker_run_unit), or'ed together. */
#define WORKER_UNIT_SNAPSHOT	0x01	/* with an active snapshot */
#define WORKER_UNIT_EXTENSION	0x02	/* on the extension's tables: its lock first */
#define WORKER_UNIT_ERROR_EXITS 0x04	/* an ERROR is not caught: the process exits */

/* A unit's work, in its transaction: its result is worker_run_unit's. */
typedef bool (*WorkerUnitWork) (void *arg);

extern bool worker_run_unit(const char *activity, int flags,
							WorkerUnitWork work, void *arg,
							ErrorData **error);
extern uint64 worker_take_own_xids(void);

#endif							/* IDEMPOTENCY_WORKER_XACT_H */
