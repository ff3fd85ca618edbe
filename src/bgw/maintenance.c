/*-------------------------------------------------------------------------
 *
 * maintenance.c
 *	  The background work, one bounded batch at a time, and
 *	  idem_run_maintenance() for setups without the worker.
 *
 * Each batch runs in the caller's transaction: the worker gives every batch
 * a transaction of its own, so that no batch holds its row locks for long,
 * while idem_run_maintenance() runs one batch of each kind in the caller's.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "access/xact.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "utils/memutils.h"
#include "utils/resowner.h"
#include "utils/timestamp.h"

#include "api/outbox.h"
#include "bgw/maintenance.h"
#include "direct/tables.h"
#include "infra/args.h"
#include "infra/guc.h"
#include "infra/shmem.h"

PG_FUNCTION_INFO_V1(idem_run_maintenance);

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
		cursor->to_prune[unit][0].span = cursor->to_prune[unit][1].span = 0;
		cursor->unpruned[unit].span = 0;
		cursor->purged_in_pass[unit] = 0;
		cursor->pruned_in_pass[unit] = 0;
	}
	cursor->publish_way = cursor->last_publish_way = PUBLISH_FAST;
	/* the caller's context outlives the batches: the worker's is TopMemoryContext */
	cursor->alone.ids = NULL;
	cursor->alone.count = cursor->alone.capacity = 0;
	cursor->alone.context = CurrentMemoryContext;
	cursor->alone_next = 0;
	cursor->alone_started = cursor->alone_progress = false;
}

/* The table a purge unit walks. */
static IdemTable
purged_table(MaintenanceUnit unit)
{
	return unit == UNIT_PURGE_KEYS ? IDEM_TABLE_KEYS : IDEM_TABLE_EVENTS;
}

/*
 * One publish batch, the way cursor->publish_way says (see PublishWay), in
 * the current transaction.  If it fails, the caller undoes the transaction
 * and calls maintenance_publish_failed, which picks the next way.
 */
static bool
publish_batch(MaintenanceCursor *cursor, MaintenanceCounts *counts)
{
	TimestampTz now = GetCurrentTimestamp();
	PublishWay	way = cursor->publish_way;
	uint64		published;
	uint64		failed;
	bool		more;

	cursor->last_publish_way = way;
	if (way == PUBLISH_ALONE && cursor->alone_next < cursor->alone.count)
	{
		int64		id = cursor->alone.ids[cursor->alone_next++];

		(void) outbox_publish_row(now, id, &cursor->alone_started, &published, &failed);
		cursor->alone_progress |= published + failed > 0;
		more = cursor->alone_next < cursor->alone.count || cursor->alone_progress;
		if (cursor->alone_next >= cursor->alone.count)
			cursor->publish_way = PUBLISH_FAST;
	}
	else
	{
		bool		careful = way == PUBLISH_CAREFULLY;
		int			limit = careful ?
			Min(idem_publish_batch_size, CAREFUL_PUBLISH_BATCH) :
			idem_publish_batch_size;
		uint64		looked_at;

		/* (a PUBLISH_ALONE whose rows are done goes the fast way) */
		cursor->last_publish_way = careful ? PUBLISH_CAREFULLY : PUBLISH_FAST;
		/* a careful batch keeps its rows' ids, to try them alone if it fails */
		looked_at = outbox_publish_batch(now, limit, careful, &published, &failed,
										 careful ? &cursor->alone : NULL);
		cursor->publish_way = PUBLISH_FAST;
		more = looked_at >= (uint64) limit && (published > 0 || careful);
	}
	counts->published += published;
	counts->publish_failures += failed;
	idem_count(IDEM_COUNTER_PUBLISHED, published);
	idem_count(IDEM_COUNTER_PUBLISH_FAILURES, failed);
	return more;
}

/*
 * After a publish batch failed with error, and its transaction (or
 * subtransaction) was rolled back: pick the next batch's way, and say
 * whether to go on at once.  A cancel, a shutdown or no memory
 * (outbox_error_counts_against_row) is not a row's fault: publishing stops
 * for now, and starts again the fast way.  Otherwise a fast batch is
 * followed by a careful one, a careful one by its rows alone, and when a row
 * alone fails after its publication began, the row is to blame: *blame is
 * set, and the caller records its failed attempt with
 * maintenance_publish_blame in a transaction that has not tried to publish
 * it.  Once the rows alone are done, publishing goes on only if one of them
 * went out or had its failure recorded, so that a failure that is no row's
 * (one that comes before any row is tried) does not go round and round.
 */
bool
maintenance_publish_failed(MaintenanceCursor *cursor, const ErrorData *error, bool *blame)
{
	*blame = false;
	if (!outbox_error_counts_against_row(error))
	{
		cursor->publish_way = PUBLISH_FAST;
		return false;
	}
	switch (cursor->last_publish_way)
	{
		case PUBLISH_FAST:
			cursor->publish_way = PUBLISH_CAREFULLY;
			return true;
		case PUBLISH_CAREFULLY:
			cursor->alone_next = 0;
			cursor->alone_progress = false;
			cursor->publish_way = cursor->alone.count > 0 ? PUBLISH_ALONE : PUBLISH_FAST;
			return cursor->alone.count > 0;
		case PUBLISH_ALONE:
			*blame = cursor->alone_started;
			if (cursor->alone_next < cursor->alone.count)
			{
				cursor->publish_way = PUBLISH_ALONE;
				return true;
			}
			cursor->publish_way = PUBLISH_FAST;
			return cursor->alone_progress;
	}
	return false;
}

/*
 * Record the failed attempt of the row maintenance_publish_failed blamed,
 * with the error its transaction failed with.  Returns whether it did (the
 * row may have stopped being pending meanwhile); if so, publishing may go on
 * at once.
 */
bool
maintenance_publish_blame(MaintenanceCursor *cursor, const char *error,
						  MaintenanceCounts *counts)
{
	int64		id = cursor->alone.ids[cursor->alone_next - 1];

	if (!outbox_record_failure(GetCurrentTimestamp(), id,
							   error != NULL ? error : "unknown error"))
		return false;
	counts->publish_failures++;
	idem_count(IDEM_COUNTER_PUBLISH_FAILURES, 1);
	cursor->alone_progress = true;
	return true;
}

/*
 * Run one batch of a unit in the current transaction, add what it did to
 * counts and to the cumulative counters, and say whether another batch has
 * work to do.
 */
bool
maintenance_batch(MaintenanceUnit unit, MaintenanceCursor *cursor,
				  MaintenanceCounts *counts)
{
	TimestampTz now = GetCurrentTimestamp();
	uint64		done = 0;
	bool		more = false;

	switch (unit)
	{
		case UNIT_PURGE_KEYS:
		case UNIT_PURGE_EVENTS:
			/* the older pages are pruned by now, kept for later, or never will be */
			cursor->to_prune[unit][0] = cursor->to_prune[unit][1];
			done = idem_purge_expired(purged_table(unit), now, idem_purge_batch_size,
									  &cursor->next_block[unit],
									  &cursor->to_prune[unit][1]);
			more = cursor->next_block[unit] != InvalidBlockNumber;
			break;
		case UNIT_PURGE_OUTBOX:
			done = outbox_purge_published(now, idem_purge_batch_size);
			more = done == (uint64) idem_purge_batch_size;
			break;
		case UNIT_PUBLISH:
			return publish_batch(cursor, counts);
		case NUM_MAINTENANCE_UNITS:
			break;
	}
	counts->purged[unit] += done;
	cursor->purged_in_pass[unit] += done;
	idem_count(IDEM_COUNTER_PURGED, done);
	return more;
}

/* How many pages *pages holds. */
static uint32
count_pages(const IdemPurgedPages *pages)
{
	uint32		count = 0;

	for (uint32 page = 0; page < pages->span; page++)
		if (pages->deleted_on[page / 64] & (UINT64CONST(1) << (page % 64)))
			count++;
	return count;
}

/*
 * Keep the pages of *pages that idem_prune_purged could not prune yet with
 * those an earlier prune left, to try again at the next one.  Both must fit
 * in one IdemPurgedPages' reach (a walk's neighbouring batches do): if not,
 * the older ones are given up, to the next vacuum.  The kept pages' rows
 * are gone once the newer of the two batches is old enough.
 */
static void
keep_unpruned(MaintenanceUnit unit, IdemPurgedPages *kept,
			  const IdemPurgedPages *pages)
{
	IdemPurgedPages merged;
	BlockNumber first;
	BlockNumber end;

	if (pages->span == 0)
		return;
	first = Min(kept->first, pages->first);
	end = Max(kept->first + kept->span, pages->first + pages->span);
	if (kept->span == 0 || end - first > IDEM_PURGE_MAX_BLOCKS)
	{
		if (kept->span > 0)
			ereport(DEBUG1,
					(errmsg_internal("%s: gave up pruning %u pages, left to vacuum",
									 maintenance_unit_names[unit], count_pages(kept))));
		*kept = *pages;
		return;
	}

	memset(&merged, 0, sizeof(merged));
	merged.first = first;
	merged.span = end - first;
	merged.xid = TransactionIdFollows(pages->xid, kept->xid) ? pages->xid : kept->xid;
	for (int i = 0; i < 2; i++)
	{
		const IdemPurgedPages *from = i == 0 ? kept : pages;

		for (uint32 page = 0; page < from->span; page++)
			if (from->deleted_on[page / 64] & (UINT64CONST(1) << (page % 64)))
			{
				uint32		to = from->first + page - first;

				merged.deleted_on[to / 64] |= UINT64CONST(1) << (to % 64);
			}
	}
	*kept = merged;
}

/*
 * Prune the pages an earlier prune could not prune yet, then those the
 * unit's purge batch before last deleted rows on, and with both, those of
 * its last batch too (see idem_prune_purged), in the current transaction,
 * under a snapshot taken after those batches committed.  The batch in
 * between gave the snapshots older than the first one's commit the time to
 * end; the caller waits for those older than the last one's.  A page that
 * cannot be pruned yet (a snapshot lasted longer, or another backend had it
 * pinned) is kept and tried again at the next prune, so that its space does
 * not wait for a vacuum.  Returns how many pages are kept, and counts those
 * pruned in cursor->pruned_in_pass.  The worker's:
 * idem_run_maintenance's batches commit with the caller's transaction,
 * after it returns, and the vacuum that autovacuum gives a table it purged
 * reclaims the space anyway.
 */
uint32
maintenance_prune(MaintenanceUnit unit, MaintenanceCursor *cursor, bool both)
{
	IdemPurgedPages *kept = &cursor->unpruned[unit];
	IdemPurgedPages retry = *kept;

	if (unit != UNIT_PURGE_KEYS && unit != UNIT_PURGE_EVENTS)
		return 0;

	/* forgotten first: a failure costs these pages, not every prune after it */
	kept->span = 0;
	cursor->pruned_in_pass[unit] += idem_prune_purged(purged_table(unit), &retry);
	*kept = retry;
	for (int i = 0; i < (both ? 2 : 1); i++)
	{
		IdemPurgedPages purged = cursor->to_prune[unit][i];

		cursor->to_prune[unit][i].span = 0;
		cursor->pruned_in_pass[unit] += idem_prune_purged(purged_table(unit), &purged);
		keep_unpruned(unit, kept, &purged);
	}
	return count_pages(kept);
}

/*
 * One publish batch for idem_run_maintenance, the ways the worker goes (see
 * PublishWay), each in a subtransaction rather than a transaction of its
 * own: the fast way (up to publish_batch_size rows in one go); if it fails,
 * the careful way (at most 32 rows, each in a subtransaction of its own, so
 * the failing row is recorded and the others go out); and if even that
 * fails, each of its rows alone, a failing one's attempt recorded once its
 * subtransaction is undone.  A failure at the caller's commit is beyond
 * reach here: the worker, whose transactions these are, records it.
 */
static void
publish_fast_then_carefully(MaintenanceCursor *cursor, MaintenanceCounts *counts)
{
	MemoryContext context = CurrentMemoryContext;
	ResourceOwner owner = CurrentResourceOwner;

	cursor->publish_way = PUBLISH_FAST;
	do
	{
		BeginInternalSubTransaction(NULL);
		MemoryContextSwitchTo(context);
		PG_TRY();
		{
			(void) maintenance_batch(UNIT_PUBLISH, cursor, counts);
			ReleaseCurrentSubTransaction();
			MemoryContextSwitchTo(context);
			CurrentResourceOwner = owner;
		}
		PG_CATCH();
		{
			ErrorData  *error;
			bool		blame;

			MemoryContextSwitchTo(context);
			error = CopyErrorData();
			FlushErrorState();
			RollbackAndReleaseCurrentSubTransaction();
			MemoryContextSwitchTo(context);
			CurrentResourceOwner = owner;

			/* a cancel, a shutdown or no memory ends the call; a failing row does not */
			if (!outbox_error_counts_against_row(error))
				ReThrowError(error);
			(void) maintenance_publish_failed(cursor, error, &blame);
			if (blame)
				(void) maintenance_publish_blame(cursor, error->message, counts);
			FreeErrorData(error);
		}
		PG_END_TRY();
	} while (cursor->publish_way != PUBLISH_FAST);
}

/*
 * idem_run_maintenance() -> (purged_keys, purged_events, purged_outbox,
 *							   published, publish_failures)
 *
 * One batch of each kind of the worker's work, in the caller's transaction:
 * for setups where shared_preload_libraries cannot be set, called by pg_cron
 * or any scheduler.
 */
Datum
idem_run_maintenance(PG_FUNCTION_ARGS)
{
	MaintenanceCursor cursor;
	MaintenanceCounts counts;
	TupleDesc	desc;
	Datum		values[5];
	bool		nulls[5] = {false};

	idem_require_writable("idem_run_maintenance()");
	if (get_call_result_type(fcinfo, NULL, &desc) != TYPEFUNC_COMPOSITE)
		elog(ERROR, "idem_run_maintenance must return a composite type");

	memset(&counts, 0, sizeof(counts));
	maintenance_cursor_init(&cursor);
	for (int unit = 0; unit < NUM_MAINTENANCE_UNITS; unit++)
	{
		if (unit == UNIT_PUBLISH)
			publish_fast_then_carefully(&cursor, &counts);
		else
		{
			/* a batch stops after a bounded stretch of the table: go on */
			while (maintenance_batch((MaintenanceUnit) unit, &cursor, &counts) &&
				   cursor.purged_in_pass[unit] < (uint64) idem_purge_batch_size)
				CHECK_FOR_INTERRUPTS();
		}
	}

	values[0] = Int64GetDatum((int64) counts.purged[UNIT_PURGE_KEYS]);
	values[1] = Int64GetDatum((int64) counts.purged[UNIT_PURGE_EVENTS]);
	values[2] = Int64GetDatum((int64) counts.purged[UNIT_PURGE_OUTBOX]);
	values[3] = Int64GetDatum((int64) counts.published);
	values[4] = Int64GetDatum((int64) counts.publish_failures);
	PG_RETURN_DATUM(HeapTupleGetDatum(heap_form_tuple(BlessTupleDesc(desc), values, nulls)));
}
