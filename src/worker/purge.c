/*-------------------------------------------------------------------------
 *
 * purge.c
 *	  The purge: deleting expired keys, processed events past retention
 *	  and published outbox rows past retention, and getting their space
 *	  back.
 *
 * Bottom up:
 *
 *	- the walk: keys and processed events have no index on expires_at (it
 *	  would make idem_complete's update non-HOT), so a purge walks the heap
 *	  in order, a bounded stretch per batch (idem_purge_expired); published
 *	  outbox rows go by SQL (outbox_purge_published);
 *
 *	- the pruning of the pages a batch deleted rows on, once no snapshot
 *	  can see them, so that the next rows reuse the space before any vacuum
 *	  (idem_prune_purged, and purge_prune, which keeps the pages it could
 *	  not prune yet for the next try);
 *
 *	- one batch of a purge in the current transaction (purge_batch), for
 *	  the worker and idem_run_maintenance();
 *
 *	- the worker's passes: each batch in a transaction of its own, yielding
 *	  to other sessions while they write, publishing while it rests, pruning
 *	  at the end of a pass, and the vacuum policy: a table a pass emptied
 *	  for the most part is vacuumed at once, twice, when the server is quiet
 *	  (purge_all).
 *
 * Owns: the walk's and the pruning's state in the cursor, the vacuum
 *	  policy, the yielding.
 * May call: infra/maintenance.h (the cursor), outbox/publish.h (publishing
 *	  while it rests), outbox/outbox_sql.h (the outbox's retention),
 *	  infra/worker_xact.h, tables/ (the tables), infra/ (settings, counters).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/heapam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/transam.h"
#include "access/xact.h"
#include "commands/vacuum.h"
#include "executor/executor.h"
#include "miscadmin.h"
#include "nodes/makefuncs.h"
#include "parser/parse_node.h"
#include "pgstat.h"
#include "portability/instr_time.h"
#include "storage/bufmgr.h"
#include "storage/freespace.h"
#include "storage/latch.h"
#include "storage/procarray.h"
#include "tcop/tcopprot.h"
#include "utils/guc.h"
#include "utils/memutils.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"
#include "utils/timestamp.h"

#include "infra/maintenance.h"
#include "outbox/publish.h"
#include "worker/purge.h"
#include "infra/worker_xact.h"
#include "compat.h"
#include "outbox/outbox_sql.h"
#include "citus/shards.h"
#include "tables/table_check.h"
#include "tables/tables.h"
#include "infra/claim_wait.h"
#include "infra/guc.h"
#include "infra/shmem.h"

/*
 * The walk of one part ended: the next batch walks the next part from its
 * first page, or, after the last, the pass is over and the next one starts
 * from the first part.
 */
static void
next_part(List *parts, BlockNumber *next_block, int *part)
{
	if (*part + 1 < list_length(parts))
	{
		(*part)++;
		*next_block = 0;
	}
	else
		*part = 0;
}

/*
 * Delete up to limit rows whose expires_at has passed, walking the heap from
 * *next_block.  The tables have no index on expires_at (it would make
 * idem_complete's update non-HOT), so the purge walks the heap in order,
 * batch after batch; *next_block is where the next batch starts, or
 * InvalidBlockNumber once the pass reached the end.  A batch also stops
 * after IDEM_PURGE_MAX_BLOCKS pages, so that one with little to delete does
 * not read a whole large table in one go while ready outbox rows wait for
 * the worker.  A row that another transaction holds or has changed is left for
 * the next pass.  *purged is set to the pages the batch deleted rows on,
 * for idem_prune_purged once it has committed.
 *
 * Where Citus distributes the table, the heaps walked are its shards on this
 * node (idem_table_parts), one after the other, *part saying which: a pass
 * ends when the last one's walk does.  A shard that moved away meanwhile is
 * skipped.  A row deleted on a shard's old placement while Citus copies
 * the shard may not reach the new one: it expired, so it behaves as absent
 * there too, and is purged there at the next pass.
 */
static uint64
idem_purge_expired(IdemTable table, TimestampTz now, int limit,
				   BlockNumber *next_block, int *part, IdemPurgedPages *purged)
{
	const ExpectedTable *def = idem_table_def(table);
	List	   *parts = idem_table_parts(table);
	Relation	heap;
	TupleDesc	desc;
	BlockNumber nblocks;
	BlockNumber start = *next_block;
	CommandId	cid = GetCurrentCommandId(true);
	Snapshot	snapshot;
	TableScanDesc scan;
	HeapTuple	tuple;
	uint64		deleted = 0;

	memset(purged, 0, sizeof(*purged));
	*next_block = InvalidBlockNumber;
	if (*part >= list_length(parts))
	{
		*part = 0;
		start = InvalidBlockNumber;
	}
	if (parts == NIL)
		return 0;				/* a Citus node without shards of the table */
	purged->relid = list_nth_oid(parts, *part);
	heap = idem_table_part_open(table, purged->relid, RowExclusiveLock);
	if (heap == NULL)
		nblocks = 0;
	else
		nblocks = RelationGetNumberOfBlocks(heap);
	if (start == InvalidBlockNumber || start >= nblocks)
		start = 0;
	purged->first = start;
	if (nblocks == 0)
	{
		if (heap != NULL)
			table_close(heap, NoLock);
		next_part(parts, next_block, part);
		return 0;
	}
	desc = RelationGetDescr(heap);

	if (nblocks - start > IDEM_PURGE_MAX_BLOCKS)
	{
		*next_block = start + IDEM_PURGE_MAX_BLOCKS;
		nblocks = start + IDEM_PURGE_MAX_BLOCKS;
	}

	CheckCmdReplicaIdentity(heap, CMD_DELETE);
	snapshot = RegisterSnapshot(GetTransactionSnapshot());
	/* no synchronized scan: the walk must start where the last batch ended */
	scan = table_beginscan_strat(heap, snapshot, 0, NULL, true, false);
	heap_setscanlimits(scan, start, nblocks - start);
	while ((tuple = heap_getnext(scan, ForwardScanDirection)) != NULL)
	{
		bool		isnull;
		Datum		expires_at = heap_getattr(tuple, def->expires_column, desc, &isnull);
		TM_FailureData tmfd;

		CHECK_FOR_INTERRUPTS();
		if (isnull || DatumGetTimestampTz(expires_at) > now)
			continue;
		if (deleted >= (uint64) limit)
		{
			*next_block = ItemPointerGetBlockNumber(&tuple->t_self);
			break;
		}
		if (table_tuple_delete(heap, &tuple->t_self, cid, snapshot, InvalidSnapshot,
							   false, &tmfd, false) == TM_Ok)
		{
			uint32		page = ItemPointerGetBlockNumber(&tuple->t_self) - start;

			purged->deleted_on[page / 64] |= UINT64CONST(1) << (page % 64);
			purged->span = page + 1;
			deleted++;
		}
	}
	table_endscan(scan);
	UnregisterSnapshot(snapshot);
	table_close(heap, NoLock);
	purged->xid = GetTopTransactionIdIfAny();
	if (*next_block == InvalidBlockNumber)
		next_part(parts, next_block, part);
	return deleted;
}

/*
 * Make the space of the rows a purge batch deleted reusable now, rather
 * than after the next vacuum, once the batch has committed: prune the pages
 * it deleted rows on, and enter their free space in the free space map.
 * Until then the rows written meanwhile would grow the table, however much
 * of it the purge emptied; and the vacuum after a large purge waits for a
 * quiet moment (see vacuum_after_purge), which a busy server may not have
 * for long.
 * The dead rows' index entries remain for the vacuum to remove, as do their
 * line pointers, left dead.  Only rows no snapshot can see any more are
 * pruned: the caller gives the snapshots older than the batch's commit time
 * to go (a batch in between, or a wait), and takes its own after that
 * (pruning goes by the horizons the last snapshot computed).
 *
 * Pruning is heap_page_prune_opt's, which every scan runs on the pages it
 * reads, with the server's rules for which rows no snapshot can still see.
 * It prunes a page only when the page looks short of room: less free space
 * than the fillfactor reserves, or PD_PAGE_FULL, the hint an UPDATE leaves
 * when its new row version did not fit.  A page that inserts filled up to
 * its fillfactor, then purged, has neither, though no insert can use it
 * until it is pruned: so we leave that hint on the page first.  Each page's
 * free space goes to the map as it is now, whoever pruned it.
 *
 * A page that cannot be pruned yet (a snapshot older than the batch's commit
 * is still open, or another backend has the page pinned) keeps the hint, so
 * the next scan to read it prunes it, but only a vacuum would enter it in the
 * map then: so it stays in *purged, for the caller to try again later, and
 * the pages done are taken out of it (as are those past the end of the
 * table, truncated meanwhile).  A page is done once none of the rows the
 * batch (or an older transaction) deleted remains: its pd_prune_xid, the
 * oldest deleter of a row pruning left, is then unset or newer than the
 * batch.  If the batch itself is not old enough yet, no page is read.
 * Returns how many pages are done.
 */
static uint32
idem_prune_purged(IdemTable table, IdemPurgedPages *purged)
{
	Relation	heap;
	BlockNumber end;
	IdemPurgedPages left;
	uint32		done = 0;
	uint32		not_yet = 0;

	if (purged->span == 0)
		return 0;
	heap = idem_table_part_open(table, purged->relid, AccessShareLock);
	if (heap == NULL)
	{
		purged->span = 0;		/* a shard moved away: nothing left to prune */
		return 0;
	}

	/*
	 * None of the batch's rows can go while a snapshot older than its commit
	 * remains.  Asked of the horizon as it is now, not as the last snapshot
	 * estimated it: until the next transaction ID is assigned, that estimate
	 * still counts a snapshot ended since, which an idle server could keep
	 * for long.  Computing it also gives heap_page_prune_opt the same.
	 */
	if (!TransactionIdPrecedes(purged->xid, GetOldestNonRemovableTransactionId(heap)))
	{
		ereport(DEBUG2,
				(errmsg_internal("could not prune the pages purged in relation \"%s\" yet: a snapshot older than the purge is still open",
								 RelationGetRelationName(heap))));
		table_close(heap, NoLock);
		return 0;
	}

	memset(&left, 0, sizeof(left));
	left.relid = purged->relid;
	left.first = purged->first;
	left.xid = purged->xid;
	end = Min(purged->first + purged->span, RelationGetNumberOfBlocks(heap));
	for (BlockNumber block = purged->first; block < end; block++)
	{
		uint32		page = block - purged->first;
		Buffer		buffer;
		Page		contents;
		Size		free_space;
		TransactionId prune_xid;

		if (!(purged->deleted_on[page / 64] & (UINT64CONST(1) << (page % 64))))
			continue;
		CHECK_FOR_INTERRUPTS();
		/* no ring: these are the pages the next inserts will go to */
		buffer = ReadBuffer(heap, block);
		contents = BufferGetPage(buffer);

		LockBuffer(buffer, BUFFER_LOCK_EXCLUSIVE);
		/* not already pruned, by a scan since the batch committed */
		if (TransactionIdIsValid(((PageHeader) contents)->pd_prune_xid) &&
			!PageIsFull(contents))
		{
			PageSetFull(contents);
			MarkBufferDirtyHint(buffer, true);
		}
		LockBuffer(buffer, BUFFER_LOCK_UNLOCK);

		heap_page_prune_opt(heap, buffer);

		LockBuffer(buffer, BUFFER_LOCK_SHARE);
		prune_xid = ((PageHeader) contents)->pd_prune_xid;
		free_space = PageGetHeapFreeSpace(contents);
		UnlockReleaseBuffer(buffer);
		RecordPageWithFreeSpace(heap, block, free_space);

		if (!TransactionIdIsValid(prune_xid) ||
			TransactionIdFollows(prune_xid, purged->xid))
			done++;
		else
		{
			left.deleted_on[page / 64] |= UINT64CONST(1) << (page % 64);
			left.span = page + 1;
			not_yet++;
		}
	}
	/* the map's upper levels, which inserts search from */
	FreeSpaceMapVacuumRange(heap, purged->first, end);
	ereport(DEBUG2,
			(errmsg_internal("pruned %u pages purged in relation \"%s\", %u left for later",
							 done, RelationGetRelationName(heap), not_yet)));
	table_close(heap, NoLock);
	*purged = left;
	return done;
}

/* The table a purge unit walks. */
static IdemTable
purged_table(MaintenanceUnit unit)
{
	return unit == UNIT_PURGE_KEYS ? IDEM_TABLE_KEYS : IDEM_TABLE_EVENTS;
}

/*
 * Run one batch of a unit in the current transaction, add what it did to
 * counts and to the cumulative counters, and say whether another batch has
 * work to do.
 */
bool
purge_batch(MaintenanceUnit unit, MaintenanceCursor *cursor,
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
									  &cursor->next_block[unit], &cursor->part[unit],
									  &cursor->to_prune[unit][1]);
			more = cursor->next_block[unit] != InvalidBlockNumber;
			/* a claim that found one of them being deleted waits for this */
			if (unit == UNIT_PURGE_KEYS && done > 0)
				claim_wait_all_changed();
			break;
		case UNIT_PURGE_OUTBOX:
			done = outbox_purge_published(now, idem_purge_batch_size);
			more = done >= (uint64) idem_purge_batch_size;
			break;
		case UNIT_PUBLISH:		/* outbox/publish.c's */
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
 * in one IdemPurgedPages' reach (a walk's neighbouring batches of one heap
 * do): if not, the older ones are given up, to the next vacuum.  The kept pages' rows
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
	if (kept->span == 0 || end - first > IDEM_PURGE_MAX_BLOCKS ||
		kept->relid != pages->relid)
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
	merged.relid = pages->relid;
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
static uint32
purge_prune(MaintenanceUnit unit, MaintenanceCursor *cursor, bool both)
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
 * ---------------------------------------------------------------------
 * The worker's passes: each batch in a transaction of its own
 * ---------------------------------------------------------------------
 */

/* The table each purge unit deletes from. */
static const char *const purged_tables[NUM_MAINTENANCE_UNITS] = {
	[UNIT_PURGE_KEYS] = "keys",
	[UNIT_PURGE_EVENTS] = "processed_events",
	[UNIT_PURGE_OUTBOX] = "outbox",
};

/* A purge's unit of work, for worker_run_unit. */
typedef struct PurgeUnit
{
	MaintenanceUnit unit;
	MaintenanceCursor *cursor;
	MaintenanceCounts counts;	/* the worker's are not kept */
	uint32		left;			/* prune_unit's */
} PurgeUnit;

/* run_batch's unit: prune the pages of the batch two before, then a batch */
static bool
batch_unit(void *arg)
{
	PurgeUnit  *purge = arg;

	(void) purge_prune(purge->unit, purge->cursor, false);
	return purge_batch(purge->unit, purge->cursor, &purge->counts);
}

/*
 * One batch of one kind of work, in a transaction of its own.  An ERROR is
 * reported and swallowed: the work is tried again next round.  Returns
 * whether another batch has work to do.  (Publishing has run_publish_batch,
 * which goes on after an ERROR.)
 */
static bool
run_batch(MaintenanceUnit unit, MaintenanceCursor *cursor)
{
	PurgeUnit	purge = {.unit = unit, .cursor = cursor};
	bool		more;

	/*
	 * A purge batch lost in a crash is simply done again, so its commit
	 * need not wait for the WAL flush, which it would otherwise share with
	 * the foreground's commits.  Publishing keeps synchronous commits (see
	 * pin_worker_settings): the setting is pinned back once the batch is
	 * over, however it ended.  (A SET LOCAL would not do: a value set at the
	 * pinning's override level outlives the transaction.)
	 */
	if (unit != UNIT_PUBLISH)
		SetConfigOption("synchronous_commit", "off", PGC_SUSET, PGC_S_OVERRIDE);

	more = worker_run_unit(maintenance_unit_names[unit],
						   WORKER_UNIT_SNAPSHOT | WORKER_UNIT_EXTENSION,
						   batch_unit, &purge, NULL);

	if (unit != UNIT_PUBLISH)
		SetConfigOption("synchronous_commit", "on", PGC_SUSET, PGC_S_OVERRIDE);

	pgstat_report_stat(false);
	return more;
}

/* vacuum_table's unit: the VACUUM, which ends and starts transactions itself */
static bool
vacuum_unit(void *stmt)
{
	ExecVacuum(make_parsestate(NULL), (VacuumStmt *) stmt, true);
	return true;
}

/*
 * VACUUM (TRUNCATE false) idempotency.<name>, as a top-level command would,
 * in a transaction started here.  ExecVacuum ends that transaction, vacuums
 * in transactions of its own and starts another, which we commit; what it is
 * given must outlive the first transaction, so it lives in vacuum_context,
 * which also parents vacuum's own memory (as a portal's context would).  No
 * truncation: it would take an ACCESS EXCLUSIVE lock that stops every claim,
 * only for the next rows to extend the file again.  An ERROR is reported and
 * swallowed: autovacuum remains.
 */
static void
vacuum_table(const char *name)
{
	static MemoryContext vacuum_context = NULL;
	MemoryContext old;
	VacuumStmt *stmt;

	if (vacuum_context == NULL)
		vacuum_context = AllocSetContextCreate(TopMemoryContext, "idempotency vacuum",
											   ALLOCSET_DEFAULT_SIZES);
	old = MemoryContextSwitchTo(vacuum_context);
	stmt = makeNode(VacuumStmt);
	stmt->options = list_make1(makeDefElem("truncate", (Node *) makeString("false"), -1));
	stmt->rels = list_make1(makeVacuumRelation(makeRangeVar("idempotency", pstrdup(name), -1),
											   InvalidOid, NIL));
	stmt->is_vacuumcmd = true;
	MemoryContextSwitchTo(old);

	PortalContext = vacuum_context;
	(void) worker_run_unit("vacuuming after a purge", 0, vacuum_unit, stmt, NULL);
	PortalContext = NULL;
	MemoryContextReset(vacuum_context);
}

/* purged_most_of's unit */
static bool
purged_most_of_unit(void *arg)
{
	PurgeUnit  *purge = arg;
	uint64		purged = purge->cursor->purged_in_pass[purge->unit];
	Relation	rel = table_openrv_extended(makeRangeVar("idempotency",
														 (char *) purged_tables[purge->unit], -1),
											AccessShareLock, true);
	bool		large;

	/* reltuples is -1 for a table never vacuumed nor analyzed */
	/*
	 * A distributed table's purged rows were in its shards, which autovacuum
	 * vacuums: the table of that name here is a shell.
	 */
	large = rel != NULL &&
		(rel->rd_rel->reltuples < 0 || purged > 1000 + 0.2 * rel->rd_rel->reltuples) &&
		idem_table_distribution(RelationGetRelid(rel)) == IDEM_DIST_LOCAL;
	if (rel != NULL)
		table_close(rel, AccessShareLock);
	return large;
}

/*
 * Did the pass delete a large share of the table?  "Large" is autovacuum's
 * default rule: more than 1000 rows plus a fifth of the table.
 */
static bool
purged_most_of(MaintenanceUnit unit, MaintenanceCursor *cursor)
{
	PurgeUnit	purge = {.unit = unit, .cursor = cursor};

	if (cursor->purged_in_pass[unit] <= 1000)
		return false;
	return worker_run_unit(NULL, 0, purged_most_of_unit, &purge, NULL);
}

/*
 * Yielding to other sessions.  A purge writes a great deal of WAL: a record
 * per row, and an image of each page it is the first to change since the
 * last checkpoint, which for rows that expired long after they were written
 * is every page.  A commit of another session waits until the WAL before
 * its own is written and flushed, so a purge run flat out beside a busy
 * foreground costs its commits about a fifth of their rate while it lasts
 * (a million rows: some 250 MB of WAL in a second or two, and 65 MB more
 * for the vacuum after it).  So while other sessions write, the purge runs
 * at most idempotency.purge_busy_share of the time, resting between batches
 * (and publishing while it rests), and the vacuum after it waits for a pass
 * that finds the database quiet; on a server that is never quiet,
 * autovacuum, which paces itself, vacuums instead.  On a quiet server, or
 * with a share of 100, the purge runs flat out.
 *
 * "Other sessions write" is read off transaction IDs: since the last look,
 * the next one moved on by more than the worker's own transactions took,
 * at a rate of more than OTHERS_WRITING_PER_S.  Autovacuum takes none, so
 * it does not count as writing; nor does an occasional transaction.  The
 * looks cover the pass only: a pass begins with one whose answer is not
 * used.
 */
#define OTHERS_WRITING_PER_S	10

static FullTransactionId xid_at_last_look;
static TimestampTz time_of_last_look;

static bool
others_write(void)
{
	FullTransactionId next = ReadNextFullTransactionId();
	TimestampTz now = GetCurrentTimestamp();
	uint64		own_xids = worker_take_own_xids();
	bool		writing = false;

	if (FullTransactionIdIsValid(xid_at_last_look))
	{
		uint64		taken = U64FromFullTransactionId(next) -
			U64FromFullTransactionId(xid_at_last_look);
		double		others = (double) taken - (double) own_xids;
		double		seconds = (double) (now - time_of_last_look) / USECS_PER_SEC;

		writing = others > 0 && others > OTHERS_WRITING_PER_S * seconds;
	}
	xid_at_last_look = next;
	time_of_last_look = now;
	return writing;
}

/*
 * Sleep up to ms milliseconds; a commit that enqueued rows ends the sleep
 * early, and they are published.
 */
static void
nap_publishing(long ms, MaintenanceCursor *cursor)
{
	(void) WaitLatch(MyLatch, WL_LATCH_SET | WL_TIMEOUT | WL_EXIT_ON_PM_DEATH,
					 ms, PG_WAIT_EXTENSION);
	CHECK_FOR_INTERRUPTS();
	publish_if_woken(cursor);
}

/* Nap until then, publishing meanwhile. */
static void
nap_until(TimestampTz until, MaintenanceCursor *cursor)
{
	long		left;

	while ((left = TimestampDifferenceMilliseconds(GetCurrentTimestamp(), until)) > 0)
		nap_publishing(left, cursor);
}

/*
 * Rest for as long as lets a purge batch that took "busy" keep to
 * idempotency.purge_busy_share of the time, publishing what commits enqueue
 * meanwhile.  Rests shorter than a millisecond add up until they are not.
 */
static void
yield_after(instr_time busy, MaintenanceCursor *cursor)
{
	static double owed_ms = 0;
	TimestampTz until;

	owed_ms += INSTR_TIME_GET_MILLISEC(busy) *
		(100 - idem_purge_busy_share) / idem_purge_busy_share;
	if (owed_ms < 1)
		return;
	until = GetCurrentTimestamp() + (TimestampTz) (owed_ms * 1000);
	owed_ms = 0;

	idem_count(IDEM_COUNTER_PURGE_YIELDS, 1);
	pgstat_report_activity(STATE_IDLE, "resting between purge batches: other sessions write");
	nap_until(until, cursor);
	pgstat_report_activity(STATE_IDLE, NULL);
}

/*
 * Do other sessions write?  Looked at over the next ms milliseconds, for a
 * pass too short to tell.
 */
static bool
others_write_over(long ms, MaintenanceCursor *cursor)
{
	(void) others_write();
	nap_until(TimestampTzPlusMilliseconds(GetCurrentTimestamp(), ms), cursor);
	return others_write();
}

/*
 * Wait, for a second at most, until no snapshot older than xid remains,
 * publishing what commits enqueue meanwhile.  A longer transaction is not
 * waited for.
 */
static void
wait_for_older_snapshots(TransactionId xid, MaintenanceCursor *cursor)
{
	for (int i = 0; i < 100; i++)
	{
		if (TransactionIdPrecedes(xid, GetOldestNonRemovableTransactionId(NULL)))
			return;
		nap_publishing(10, cursor);
	}
}

/*
 * Say at DEBUG1 how many pages a pass pruned and how many it left for the
 * next (what the tests wait for).
 */
static void
report_pruned(MaintenanceUnit unit, MaintenanceCursor *cursor, uint32 left)
{
	if (left == 0)
		ereport(DEBUG1,
				(errmsg_internal("pruned %llu pages of relation \"%s\" in this pass: none left to prune",
								 (unsigned long long) cursor->pruned_in_pass[unit],
								 purged_tables[unit])));
	else
		ereport(DEBUG1,
				(errmsg_internal("pruned %llu pages of relation \"%s\" in this pass: %u left to prune next pass",
								 (unsigned long long) cursor->pruned_in_pass[unit],
								 purged_tables[unit], left)));
}

/* prune_after_pass's unit */
static bool
prune_unit(void *arg)
{
	PurgeUnit  *purge = arg;

	purge->left = purge_prune(purge->unit, purge->cursor, true);
	return true;
}

/*
 * Prune the pages the last two batches of a purge deleted rows on (run_batch
 * prunes those of the batches before), and those an earlier prune could not
 * prune yet, in a transaction of its own, once the snapshots older than the
 * last batch's commit are gone.  Pages still left (a snapshot outlasted the
 * wait, or a page was pinned) are tried again by the next pass's batches and
 * at its end.
 */
static void
prune_after_pass(MaintenanceUnit unit, MaintenanceCursor *cursor)
{
	IdemPurgedPages *last = &cursor->to_prune[unit][1];
	PurgeUnit	purge = {.unit = unit, .cursor = cursor};

	if (last->span == 0 && cursor->to_prune[unit][0].span == 0 &&
		cursor->unpruned[unit].span == 0)
	{
		if (cursor->pruned_in_pass[unit] > 0)
			report_pruned(unit, cursor, 0);
		return;
	}
	if (last->span > 0)
		wait_for_older_snapshots(last->xid, cursor);
	/* which rows are dead to all goes by the horizons of its snapshot */
	if (worker_run_unit(maintenance_unit_names[unit],
						WORKER_UNIT_SNAPSHOT | WORKER_UNIT_EXTENSION,
						prune_unit, &purge, NULL))
		report_pruned(unit, cursor, purge.left);	/* (not after an ERROR) */
}

/* A transaction ID taken, and committed: see vacuum_after_purge. */
static bool
take_xid_unit(void *arg)
{
	*(TransactionId *) arg = GetTopTransactionId();
	return true;
}

/*
 * After a pass that deleted most of a table, vacuum it now rather than when
 * autovacuum next looks (up to autovacuum_naptime later, and only past its
 * own thresholds): until a vacuum, the deleted rows' space cannot be reused,
 * and the next rows to expire would grow the table instead.  If other
 * sessions wrote during the pass, or do in the tenth of a second after it
 * (a pass can be too short to tell), the vacuum is owed until a pass finds
 * them quiet (see others_write).
 *
 * Twice: the index pages the first vacuum empties and deletes may be reused
 * only once every transaction that could still be reading them has ended,
 * which a transaction ID taken after their deletion proves once every
 * snapshot older than it is gone (a moment's wait for the queries running
 * meanwhile); the second vacuum then finds them safe and hands them to the
 * free space map, where the next rows' index entries find them.  Otherwise
 * the indexes would keep a second copy of their size until some later
 * vacuum.  Rows enqueued meanwhile are published before each vacuum.
 */
static void
vacuum_after_purge(MaintenanceCursor *cursor, MaintenanceUnit unit,
				   bool busy_in_pass)
{
	static bool owed[NUM_MAINTENANCE_UNITS];
	TransactionId burned;

	if (purged_most_of(unit, cursor))
		owed[unit] = true;
	if (!owed[unit] || busy_in_pass ||
		(idem_purge_busy_share < 100 && others_write_over(100, cursor)))
		return;

	publish_if_woken(cursor);
	vacuum_table(purged_tables[unit]);

	(void) worker_run_unit(NULL, WORKER_UNIT_ERROR_EXITS, take_xid_unit, &burned, NULL);
	wait_for_older_snapshots(burned, cursor);

	publish_if_woken(cursor);
	vacuum_table(purged_tables[unit]);
	owed[unit] = false;
}

/*
 * Purge each table to the end.  Between purge batches, a commit that
 * enqueued events (our latch is set) gets its rows published first, so that
 * a long purge does not delay them; while other sessions write, the purge
 * yields to them.  Each batch begins by pruning the pages the batch two
 * before it deleted rows on, whose rows the snapshots older than its commit
 * have had a batch's time to stop seeing, and the pass ends by pruning
 * those of its last two; so the rows others write meanwhile reuse the space
 * (see idem_prune_purged).
 */
void
purge_all(MaintenanceCursor *cursor)
{
	/* what others wrote before the pass began does not count */
	(void) others_write();

	for (int unit = UNIT_PURGE_KEYS; unit <= UNIT_PURGE_OUTBOX; unit++)
	{
		bool		more;
		bool		busy_in_pass = false;

		cursor->purged_in_pass[unit] = 0;
		cursor->pruned_in_pass[unit] = 0;
		do
		{
			instr_time	start;
			instr_time	took;
			bool		busy;

			INSTR_TIME_SET_CURRENT(start);
			more = run_batch((MaintenanceUnit) unit, cursor);
			INSTR_TIME_SET_CURRENT(took);
			INSTR_TIME_SUBTRACT(took, start);

			busy = others_write() && idem_purge_busy_share < 100;
			busy_in_pass |= busy;
			if (more)
			{
				CHECK_FOR_INTERRUPTS();
				if (busy)
					yield_after(took, cursor);
				publish_if_woken(cursor);
			}
		} while (more);
		prune_after_pass((MaintenanceUnit) unit, cursor);
		vacuum_after_purge(cursor, (MaintenanceUnit) unit, busy_in_pass);
	}
}
