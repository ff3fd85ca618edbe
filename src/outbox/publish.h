/*-------------------------------------------------------------------------
 *
 * publish.h
 *	  Publishing the outbox, for the worker and idem_run_maintenance().
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_PUBLISH_H
#define IDEMPOTENCY_PUBLISH_H

#include "infra/maintenance.h"

/* idem_run_maintenance: one batch, retried carefully, in subtransactions */
extern void publish_fast_then_carefully(MaintenanceCursor *cursor,
										MaintenanceCounts *counts);

/* The worker: each batch in a transaction of its own. */
extern void publish_all(MaintenanceCursor *cursor);
extern void publish_if_woken(MaintenanceCursor *cursor);

#endif							/* IDEMPOTENCY_PUBLISH_H */
