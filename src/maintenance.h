/*-------------------------------------------------------------------------
 *
 * maintenance.h
 *	  One round of the background work: purge expired rows, publish ready
 *	  outbox rows.  Shared by the worker and idem_run_maintenance().
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_MAINTENANCE_H
#define IDEMPOTENCY_MAINTENANCE_H

#include "storage/block.h"

#include "tables.h"

/* The kinds of work, each done in bounded batches. */
typedef enum MaintenanceUnit
{
	UNIT_PURGE_KEYS,
	UNIT_PURGE_EVENTS,
	UNIT_PURGE_OUTBOX,
	UNIT_PUBLISH,
	NUM_MAINTENANCE_UNITS
} MaintenanceUnit;

/*
 * Where the work stands between batches: each purge's walk over its heap,
 * the pages its last two batches deleted rows on, the older first, and
 * those of earlier batches that could not be pruned yet (for
 * maintenance_prune), and whether the next publish batch must go carefully
 * (a row in it failed the fast way).
 */
typedef struct MaintenanceCursor
{
	BlockNumber next_block[NUM_MAINTENANCE_UNITS];
	IdemPurgedPages to_prune[NUM_MAINTENANCE_UNITS][2];
	IdemPurgedPages unpruned[NUM_MAINTENANCE_UNITS];
	uint64		purged_in_pass[NUM_MAINTENANCE_UNITS];	/* reset by the caller */
	uint64		pruned_in_pass[NUM_MAINTENANCE_UNITS];	/* pages; likewise */
	bool		publish_carefully;
	bool		last_publish_was_fast;	/* so a failed one is retried at once */
} MaintenanceCursor;

/* Rows per careful publish batch: each takes a subtransaction. */
#define CAREFUL_PUBLISH_BATCH	32

/* What a batch did. */
typedef struct MaintenanceCounts
{
	uint64		purged[NUM_MAINTENANCE_UNITS];
	uint64		published;
	uint64		publish_failures;
} MaintenanceCounts;

extern const char *const maintenance_unit_names[NUM_MAINTENANCE_UNITS];

extern void maintenance_cursor_init(MaintenanceCursor *cursor);
extern bool maintenance_batch(MaintenanceUnit unit, MaintenanceCursor *cursor,
							  MaintenanceCounts *counts);
extern uint32 maintenance_prune(MaintenanceUnit unit, MaintenanceCursor *cursor,
								bool both);

#endif							/* IDEMPOTENCY_MAINTENANCE_H */
