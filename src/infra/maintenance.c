/*-------------------------------------------------------------------------
 *
 * maintenance.c
 *	  The background work's cursor: where each purge's walk stands, which
 *	  pages are left to prune, and how the next publish batch goes; and the
 *	  names of the kinds of work, for pg_stat_activity and the log.
 *
 * Owns: the cursor's initial state.
 * May call: nothing of ours.  Used by worker/purge.c, outbox/publish.c,
 *	  worker/worker.c and worker/run_maintenance.c.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "infra/maintenance.h"

const char *const maintenance_unit_names[NUM_MAINTENANCE_UNITS] = {
	[UNIT_PURGE_KEYS] = "purging expired keys",
	[UNIT_PURGE_EVENTS] = "purging processed events past retention",
	[UNIT_PURGE_OUTBOX] = "purging published outbox rows",
	[UNIT_PUBLISH] = "publishing outbox rows",
};

void
maintenance_cursor_init(MaintenanceCursor *cursor)
{
	for (int unit = 0; unit < NUM_MAINTENANCE_UNITS; unit++)
	{
		cursor->next_block[unit] = InvalidBlockNumber;
		cursor->part[unit] = 0;
		cursor->to_prune[unit][0].span = cursor->to_prune[unit][1].span = 0;
		cursor->unpruned[unit].span = 0;
		cursor->purged_in_pass[unit] = 0;
		cursor->pruned_in_pass[unit] = 0;
	}
	cursor->publish_way = cursor->last_publish_way = PUBLISH_FAST;
	cursor->outbox_shard = InvalidOid;
	cursor->outbox_part = 0;
	cursor->outbox_shards = NULL;
	cursor->noutbox_shards = -1;
	cursor->walked = cursor->walking = cursor->round_starts = NIL;
	cursor->started_at = cursor->oldest_walked_at = 0;
	/* the caller's context outlives the batches: the worker's is TopMemoryContext */
	cursor->alone.ids = NULL;
	cursor->alone.count = cursor->alone.capacity = 0;
	cursor->alone.context = CurrentMemoryContext;
	cursor->alone_next = 0;
	cursor->alone_started = cursor->alone_progress = false;
}
