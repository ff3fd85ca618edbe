/*-------------------------------------------------------------------------
 *
 * events.c
 *	  Consumer deduplication: idem_mark_processed and idem_is_processed.
 *
 * A message handler calls idem_mark_processed inside its own transaction,
 * so that the mark and the handler's writes commit or vanish together.  The
 * answer is true the first time (process the event) and false for a
 * duplicate (skip it, acknowledge it).  Unlike idem_claim, a duplicate that
 * arrives while the first delivery is still in flight waits for it: false if
 * it commits, true if it rolls back.  That is INSERT ... ON CONFLICT DO
 * NOTHING's behaviour, done with the same direct probe-and-insert as keys.c
 * (see tables.c) so that a mark costs one index probe and one insert.
 *
 * An event past its retention counts as not processed, before any purge:
 * marking it again renews the row.
 *
 * Owns: idem_mark_processed and idem_is_processed.
 * May call: direct/tables.h, infra/ (argument checks, settings).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "miscadmin.h"
#include "storage/lmgr.h"
#include "utils/timestamp.h"

#include "direct/tables.h"
#include "infra/args.h"
#include "infra/guc.h"

PG_FUNCTION_INFO_V1(idem_mark_processed);
PG_FUNCTION_INFO_V1(idem_is_processed);

static bool
event_expired(HeapTuple tuple, TupleDesc desc, TimestampTz now)
{
	bool		isnull;
	Datum		expires_at = heap_getattr(tuple, Anum_events_expires_at, desc, &isnull);

	return !isnull && DatumGetTimestampTz(expires_at) <= now;
}

/*
 * idem_mark_processed(consumer, event_id, retention) -> boolean
 */
Datum
idem_mark_processed(PG_FUNCTION_ARGS)
{
	text	   *consumer = idem_arg_identifier(fcinfo, 0, "consumer", 1);
	text	   *event_id = idem_arg_identifier(fcinfo, 1, "event_id", 1);
	Interval   *retention = idem_arg_duration(fcinfo, 2, "retention",
											  (int64) idem_event_retention_s * 1000);
	Datum		pkey[2] = {PointerGetDatum(consumer), PointerGetDatum(event_id)};
	IdemRelation rel;
	bool		first_time;

	idem_require_writable("idem_mark_processed()");
	idem_relation_open(&rel, IDEM_TABLE_EVENTS, RowExclusiveLock);

	for (;;)
	{
		ProbeResult found;
		TimestampTz now;
		Datum		values[Natts_events];
		bool		nulls[Natts_events] = {false};
		TM_Result	tm;

		CHECK_FOR_INTERRUPTS();
		idem_probe(&rel, pkey, &found);

		if (found.outcome == PROBE_INSERTING)
		{
			/* a concurrent delivery of the same event: wait for its outcome */
			if (found.speculative_token != 0)
				SpeculativeInsertionWait(found.inserting_xid, found.speculative_token);
			else
				XactLockTableWait(found.inserting_xid, rel.heap, NULL, XLTW_InsertIndexUnique);
			continue;
		}
		if (found.outcome == PROBE_FOUND && found.being_modified)
		{
			XactLockTableWait(found.modifying_xid, rel.heap, &found.tid, XLTW_Update);
			continue;
		}

		now = GetCurrentTimestamp();
		if (found.outcome == PROBE_FOUND &&
			!event_expired(found.tuple, RelationGetDescr(rel.heap), now))
		{
			first_time = false;
			break;
		}

		values[Anum_events_consumer - 1] = PointerGetDatum(consumer);
		values[Anum_events_event_id - 1] = PointerGetDatum(event_id);
		values[Anum_events_processed_at - 1] = TimestampTzGetDatum(now);
		values[Anum_events_expires_at - 1] =
			TimestampTzGetDatum(idem_timestamp_plus(now, retention));

		if (found.outcome == PROBE_ABSENT)
		{
			if (idem_insert_unique(&rel, values, nulls))
			{
				first_time = true;
				break;
			}
			continue;			/* lost a race: look again (and wait) */
		}

		/* past its retention: the event counts as new, renew the row */
		tm = idem_update(&rel, &found.tid, values, nulls, true);
		if (tm == TM_Ok)
		{
			first_time = true;
			break;
		}
		if (tm != TM_Updated && tm != TM_Deleted)
			elog(ERROR, "unexpected result %d renewing a processed event", (int) tm);
	}

	idem_relation_close(&rel);
	PG_RETURN_BOOL(first_time);
}

/*
 * idem_is_processed(consumer, event_id) -> boolean
 *
 * Only looks: true if a mark is committed (or made by this transaction) and
 * within its retention.  A mark still in flight elsewhere is not counted,
 * since it may roll back.  Works in read-only transactions and on standbys.
 */
Datum
idem_is_processed(PG_FUNCTION_ARGS)
{
	text	   *consumer = idem_arg_identifier(fcinfo, 0, "consumer", 1);
	text	   *event_id = idem_arg_identifier(fcinfo, 1, "event_id", 1);
	Datum		pkey[2] = {PointerGetDatum(consumer), PointerGetDatum(event_id)};
	IdemRelation rel;
	ProbeResult found;
	bool		processed;

	idem_relation_open(&rel, IDEM_TABLE_EVENTS, AccessShareLock);
	idem_probe(&rel, pkey, &found);
	processed = found.outcome == PROBE_FOUND &&
		!event_expired(found.tuple, RelationGetDescr(rel.heap), GetCurrentTimestamp());
	idem_relation_close(&rel);

	PG_RETURN_BOOL(processed);
}
