/*-------------------------------------------------------------------------
 *
 * purge.h
 *	  The purge of expired rows, for the worker and idem_run_maintenance().
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_PURGE_H
#define IDEMPOTENCY_PURGE_H

#include "infra/maintenance.h"

/* One batch of a purge unit, in the current transaction. */
extern bool purge_batch(MaintenanceUnit unit, MaintenanceCursor *cursor,
						MaintenanceCounts *counts);

/* The worker: a pass over each table, each batch in a transaction of its own. */
extern void purge_all(MaintenanceCursor *cursor);

#endif							/* IDEMPOTENCY_PURGE_H */
