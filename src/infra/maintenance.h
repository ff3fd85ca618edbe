/*-------------------------------------------------------------------------
 *
 * maintenance.h
 *	  Where the background work stands between batches (the cursor), and
 *	  what a batch did: shared by the purge (purge.c), publishing
 *	  (publish.c), the worker and idem_run_maintenance().
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_MAINTENANCE_H
#define IDEMPOTENCY_MAINTENANCE_H

#include "postgres_ext.h"
#include "nodes/pg_list.h"
#include "storage/block.h"
#include "datatype/timestamp.h"

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
 * The pages a purge batch deleted rows on, for idem_prune_purged (purge.c):
 * bit i of deleted_on stands for page first + i, of the span pages a batch
 * reads at most; the relation (the table, or on Citus one of its shards);
 * and the batch's transaction.
 */
#define IDEM_PURGE_MAX_BLOCKS	1024
typedef struct IdemPurgedPages
{
	BlockNumber first;
	uint32		span;			/* bits past the last one set: 0 for none */
	uint64		deleted_on[IDEM_PURGE_MAX_BLOCKS / 64];
	Oid			relid;
	TransactionId xid;
} IdemPurgedPages;

/* Row ids, kept in context (which outlives a transaction) between batches. */
typedef struct OutboxRowIds
{
	int64	   *ids;
	uint64		count;
	uint64		capacity;
	MemoryContext context;
} OutboxRowIds;

/*
 * How the next publish batch goes.  The fast way publishes up to
 * publish_batch_size rows in one transaction.  When that fails, the careful
 * way follows at once: at most CAREFUL_PUBLISH_BATCH rows, each in a
 * subtransaction of its own, so that a row whose route raises an ERROR has
 * its attempt recorded and the others go out.  When even that fails (the
 * failure came after a row's subtransaction, or at commit), each row of that
 * careful batch goes alone, in a transaction of its own, and a row whose own
 * transaction fails has its failed attempt recorded in another
 * (publish_failed).  So a row is never tried for ever with its
 * attempts at 0, holding up the rest.
 */
typedef enum PublishWay
{
	PUBLISH_FAST,
	PUBLISH_CAREFULLY,
	PUBLISH_ALONE
} PublishWay;

/*
 * Where the work stands between batches: each purge's walk over its heaps
 * (part: the table, or on Citus which of its shards on this node),
 * the pages its last two batches deleted rows on, the older first, and
 * those of earlier batches that could not be pruned yet (for
 * purge_prune), and how the next publish batch goes (see
 * PublishWay).
 */
typedef struct MaintenanceCursor
{
	BlockNumber next_block[NUM_MAINTENANCE_UNITS];
	int			part[NUM_MAINTENANCE_UNITS];
	IdemPurgedPages to_prune[NUM_MAINTENANCE_UNITS][2];
	IdemPurgedPages unpruned[NUM_MAINTENANCE_UNITS];
	uint64		purged_in_pass[NUM_MAINTENANCE_UNITS];	/* reset by the caller */
	uint64		pruned_in_pass[NUM_MAINTENANCE_UNITS];	/* pages; likewise */
	PublishWay	publish_way;	/* the next publish batch's */
	PublishWay	last_publish_way;	/* the last one's, for publish_failed */
	/* PUBLISH_ALONE: the rows of the careful batch that failed, in the caller's context */
	OutboxRowIds alone;
	uint64		alone_next;		/* the next of them to try */
	bool		alone_started;	/* the last one tried began to be published */
	bool		alone_progress; /* one of them was published, or its failure recorded */
	/* a distributed outbox: the shard of the batch, and its place among this node's */
	Oid			outbox_shard;
	int			outbox_part;
	/* ... this node's shards, read once a round (-1: at the next batch), in alone.context */
	Oid		   *outbox_shards;
	int			noutbox_shards;
	/*
	 * where the walks of the outbox go on (outbox/publish.c's WalkPoints, in
	 * alone.context): those of this round's last committed batch, those of
	 * the batch under way, and where each round's walks start; when the
	 * walks last started at round_starts, and when at each topic's oldest
	 * entry
	 */
	List	   *walked;
	List	   *walking;
	List	   *round_starts;
	TimestampTz started_at;
	TimestampTz oldest_walked_at;
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

#endif							/* IDEMPOTENCY_MAINTENANCE_H */
