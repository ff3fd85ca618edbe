/*-------------------------------------------------------------------------
 *
 * events.c
 *	  Consumer deduplication: idem_mark_processed and idem_is_processed,
 *	  one event or a batch of them.
 *
 * A message handler calls idem_mark_processed inside its own transaction,
 * so that the mark and the handler's writes commit or vanish together.  The
 * answer is true the first time (process the event) and false for a
 * duplicate (skip it, acknowledge it).  Unlike idem_claim, a duplicate that
 * arrives while the first delivery is still in flight waits for it: false if
 * it commits, true if it rolls back.  That is INSERT ... ON CONFLICT DO
 * NOTHING's behaviour, and the single calls are that statement (and a
 * SELECT to look), through kept plans: the direct path bought them nothing
 * measurable (issue 29; doc/internals.md, "C where it pays").
 *
 * An event past its retention counts as not processed, before any purge:
 * marking it again renews the row.
 *
 * The batch forms take the ids a broker hands over in one poll and answer
 * for each id exactly as the single call does, in one call: one round
 * trip.  Each answers with the ids it would have answered true for, in the
 * array's order.  idem_is_processed_batch is one SELECT of them all;
 * idem_mark_processed_batch marks them through the direct path (tables.c:
 * a probe under a dirty snapshot and speculative insertion, the table
 * opened once), which is where C pays: 1.4x to 2.2x the same batch as one
 * INSERT ... SELECT ... ON CONFLICT DO NOTHING.  A batch marks its ids in
 * one canonical order, bytewise (the columns are COLLATE "C"), whatever the
 * array's: a batch that waits for another's mark holds only marks of ids
 * before it in that order, so two batches that overlap can never wait for
 * each other in a circle.
 *
 * Owns: idem_mark_processed, idem_is_processed and their batch forms.
 * May call: tables/tables.h, infra/ (argument checks, settings, run_as.h).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "storage/lmgr.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/timestamp.h"
#include "utils/tuplestore.h"

#include "compat.h"
#include "tables/tables.h"
#include "infra/args.h"
#include "infra/guc.h"
#include "infra/plan_settings.h"
#include "infra/run_as.h"

PG_FUNCTION_INFO_V1(idem_mark_processed);
PG_FUNCTION_INFO_V1(idem_is_processed);
PG_FUNCTION_INFO_V1(idem_mark_processed_batch);
PG_FUNCTION_INFO_V1(idem_is_processed_batch);

static bool
event_expired(HeapTuple tuple, TupleDesc desc, TimestampTz now)
{
	bool		isnull;
	Datum		expires_at = heap_getattr(tuple, Anum_events_expires_at, desc, &isnull);

	return !isnull && DatumGetTimestampTz(expires_at) <= now;
}

/*
 * Mark one event processed for a consumer: true the first time, false for a
 * duplicate.  A mark that another transaction is making right now is waited
 * for, and then counts by its outcome.  The relation is open with
 * RowExclusiveLock; the caller has checked the arguments.
 *
 * With *assume_new, the first look is skipped: the row is inserted at once,
 * as if the probe had found nothing.  That is safe, since the insertion's own
 * uniqueness check notices any row or insertion in flight with the key, and
 * then (as after a lost race) the row is looked up as usual; *assume_new is
 * cleared then, for the caller's next events too.  A batch of new events
 * descends the primary key once per event instead of twice; a redelivered
 * batch pays for one wasted insertion (a dead row version, as a lost race
 * leaves) before it looks first.
 *
 * *clock is the mark's time and the row's expiry: read (and the retention
 * added, a calendar computation) on first use, and kept for the caller's
 * next events, so that a batch reads the clock once; after a wait it is read
 * again.
 */
typedef struct MarkClock
{
	bool		valid;
	TimestampTz now;
	TimestampTz expires_at;		/* now + retention */
} MarkClock;

static bool
mark_event(IdemRelation *rel, text *consumer, text *event_id,
		   const Interval *retention, bool *assume_new, MarkClock *clock)
{
	Datum		pkey[2] = {PointerGetDatum(consumer), PointerGetDatum(event_id)};

	for (;;)
	{
		ProbeResult found;
		TimestampTz now;
		Datum		values[Natts_events];
		bool		nulls[Natts_events] = {false};
		TM_Result	tm;

		CHECK_FOR_INTERRUPTS();
		if (*assume_new)
			found.outcome = PROBE_ABSENT;
		else
			idem_probe(rel, pkey, &found);

		if (found.outcome == PROBE_INSERTING)
		{
			/* a concurrent delivery of the same event: wait for its outcome */
			if (found.speculative_token != 0)
				SpeculativeInsertionWait(found.inserting_xid, found.speculative_token);
			else
				XactLockTableWait(found.inserting_xid, rel->heap, NULL, XLTW_InsertIndexUnique);
			clock->valid = false;
			continue;
		}
		if (found.outcome == PROBE_FOUND && found.being_modified)
		{
			XactLockTableWait(found.modifying_xid, rel->heap, &found.tid, XLTW_Update);
			clock->valid = false;
			continue;
		}

		if (!clock->valid)
		{
			clock->now = GetCurrentTimestamp();
			clock->expires_at = idem_timestamp_plus(clock->now, retention);
			clock->valid = true;
		}
		now = clock->now;
		if (found.outcome == PROBE_FOUND &&
			!event_expired(found.tuple, RelationGetDescr(rel->heap), now))
			return false;

		values[Anum_events_consumer - 1] = PointerGetDatum(consumer);
		values[Anum_events_event_id - 1] = PointerGetDatum(event_id);
		values[Anum_events_processed_at - 1] = TimestampTzGetDatum(now);
		values[Anum_events_expires_at - 1] = TimestampTzGetDatum(clock->expires_at);

		if (found.outcome == PROBE_ABSENT)
		{
			if (idem_insert_unique(rel, values, nulls))
				return true;
			/* lost a race, or the row was there: look again (and wait) */
			*assume_new = false;
			continue;
		}

		/* past its retention: the event counts as new, renew the row */
		tm = idem_update(rel, &found.tid, values, nulls, true);
		if (tm == TM_Ok)
			return true;
		if (tm != TM_Updated && tm != TM_Deleted)
			elog(ERROR, "unexpected result %d renewing a processed event", (int) tm);
	}
}

/*
 * The statements of the single calls and of the batch look: one per call
 * (two for a duplicate mark, whose retention may have passed), through
 * plans kept for the backend's life, run as the table's owner with
 * search_path pinned (infra/run_as.c), as the outbox's statements are: the
 * caller needs EXECUTE on the function, not rights on the table.  INSERT
 * ... ON CONFLICT DO NOTHING waits for a mark in flight and then counts it
 * by its outcome.  Under READ COMMITTED each statement reads the latest
 * committed state; under REPEATABLE READ or SERIALIZABLE, a duplicate
 * committed after the snapshot fails with 40001, as the INSERT would.  %s
 * is the table: the table itself, or its shard on this node where Citus
 * distributes it (planned per call there).
 */
typedef enum EventStatement
{
	EV_MARK,
	EV_RENEW,
	EV_LOOK,
	EV_LOOK_BATCH,
	EV_NUM_STATEMENTS
} EventStatement;

static const char *const event_sql[EV_NUM_STATEMENTS] = {
	[EV_MARK] = "INSERT INTO %s (consumer, event_id, processed_at, expires_at)"
	" VALUES ($1, $2, $3, $4) ON CONFLICT (consumer, event_id) DO NOTHING",
	[EV_RENEW] = "UPDATE %s SET processed_at = $3, expires_at = $4"
	" WHERE consumer = $1 AND event_id = $2 AND expires_at <= $3",
	[EV_LOOK] = "SELECT 1 FROM %s"
	" WHERE consumer = $1 AND event_id = $2 AND expires_at > $3",
	[EV_LOOK_BATCH] = "SELECT event_id FROM %s"
	" WHERE consumer = $1 AND event_id = ANY ($2) AND expires_at > $3",
};

/*
 * The batch look gets a custom plan at each call, as the SQL edition's
 * (and a session's plan_cache_mode cannot undo it): with the ids a
 * constant array, = ANY is a hashed lookup wherever it is a filter, and
 * the planner knows how many ids it probes for.  A generic plan, made
 * while the consumer had a few rows, read all of them (a sequential scan,
 * or the primary key by consumer alone) and tested each against the whole
 * array ($2 a parameter, = ANY a linear search): over a minute to look up
 * 100,000 ids among as many rows, against 0.2 s.  The others are left to
 * plancache.c (one row each, by the primary key).
 */
static const IdemPlanMode event_plan[EV_NUM_STATEMENTS] = {
	[EV_LOOK_BATCH] = IDEM_PLAN_CUSTOM,
};

static SPIPlanPtr event_plans[EV_NUM_STATEMENTS];

/* Where the statements run (the table, or a shard), and as whom. */
typedef struct EventSql
{
	IdemRunAs	run_as;
	Oid			shard;
	char	   *shard_name;
} EventSql;

static void
event_sql_begin(EventSql *context, text *consumer, LOCKMODE lockmode,
				const char *function_name)
{
	Oid			owner = idem_table_owner(IDEM_TABLE_EVENTS, consumer, lockmode,
										 function_name, &context->shard);

	context->shard_name = OidIsValid(context->shard) ?
		quote_qualified_identifier(get_namespace_name(get_rel_namespace(context->shard)),
								   get_rel_name(context->shard)) : NULL;
	idem_run_as_begin(&context->run_as, owner, SECURITY_LOCAL_USERID_CHANGE);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
}

static void
event_sql_end(EventSql *context)
{
	SPI_finish();
	idem_run_as_end(&context->run_as, true);
}

/* Run a statement with consumer, the id (or ids), now and the expiry. */
static uint64
event_sql_run(EventSql *context, EventStatement statement, text *consumer,
			  Datum ids, TimestampTz now, TimestampTz expires_at)
{
	bool		batch = statement == EV_LOOK_BATCH;
	Oid			types[4] = {TEXTOID, batch ? TEXTARRAYOID : TEXTOID,
	TIMESTAMPTZOID, TIMESTAMPTZOID};
	Datum		values[4] = {PointerGetDatum(consumer), ids,
	TimestampTzGetDatum(now), TimestampTzGetDatum(expires_at)};
	int			nargs = statement == EV_LOOK || statement == EV_LOOK_BATCH ? 3 : 4;
	SPIPlanPtr	plan;
	int			ret;
	int			guc_nest_level;

	if (context->shard_name != NULL)
		plan = SPI_prepare_cursor(psprintf(event_sql[statement], context->shard_name),
								  nargs, types, idem_plan_cursor_options(event_plan[statement]));
	else
	{
		if (event_plans[statement] == NULL)
		{
			SPIPlanPtr	prepared = SPI_prepare_cursor(psprintf(event_sql[statement],
															   "idempotency.processed_events"),
													  nargs, types,
													  idem_plan_cursor_options(event_plan[statement]));

			if (prepared == NULL || SPI_keepplan(prepared) != 0)
				elog(ERROR, "could not prepare event statement %d: %s",
					 (int) statement, SPI_result_code_string(SPI_result));
			event_plans[statement] = prepared;
		}
		plan = event_plans[statement];
	}
	if (plan == NULL)
		elog(ERROR, "could not prepare event statement %d: %s",
			 (int) statement, SPI_result_code_string(SPI_result));
	guc_nest_level = idem_plan_settings_begin(event_plan[statement], false);
	ret = SPI_execute_plan(plan, values, NULL, false, 0);
	idem_plan_settings_end(guc_nest_level);
	if (ret < 0)
		elog(ERROR, "event statement %d failed: %s",
			 (int) statement, SPI_result_code_string(ret));
	return SPI_processed;
}

static bool
mark_event_sql(text *consumer, text *event_id, const Interval *retention)
{
	EventSql	context;
	TimestampTz now = GetCurrentTimestamp();
	TimestampTz expires_at = idem_timestamp_plus(now, retention);
	bool		first_time;

	event_sql_begin(&context, consumer, RowExclusiveLock, "idem_mark_processed()");
	first_time = event_sql_run(&context, EV_MARK, consumer, PointerGetDatum(event_id),
							   now, expires_at) > 0 ||
		event_sql_run(&context, EV_RENEW, consumer, PointerGetDatum(event_id),
					  now, expires_at) > 0;
	event_sql_end(&context);
	return first_time;
}

static bool
event_processed_sql(text *consumer, text *event_id)
{
	EventSql	context;
	bool		processed;

	event_sql_begin(&context, consumer, AccessShareLock, "idem_is_processed()");
	processed = event_sql_run(&context, EV_LOOK, consumer, PointerGetDatum(event_id),
							  GetCurrentTimestamp(), 0) > 0;
	event_sql_end(&context);
	return processed;
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

	idem_require_writable("idem_mark_processed()");
	PG_RETURN_BOOL(mark_event_sql(consumer, event_id, retention));
}

/*
 * idem_is_processed(consumer, event_id) -> boolean
 *
 * Only looks.  Works in read-only transactions and on standbys.
 */
Datum
idem_is_processed(PG_FUNCTION_ARGS)
{
	text	   *consumer = idem_arg_identifier(fcinfo, 0, "consumer", 1);
	text	   *event_id = idem_arg_identifier(fcinfo, 1, "event_id", 1);

	PG_RETURN_BOOL(event_processed_sql(consumer, event_id));
}

/*
 * The event ids of a batch call, checked, and in the order they are worked
 * on: each distinct id once, bytewise.
 */
typedef struct EventBatch
{
	int			nids;			/* the array's elements */
	Datum	   *ids;			/* ... in the array's order */
	int			ndistinct;		/* the distinct ids */
	int		   *order;			/* the position in ids of each one's first
								 * occurrence, bytewise by id */
	bool	   *answer;			/* per position: true to return the id there */
} EventBatch;

/* Bytewise, as COLLATE "C" orders text; the first occurrence first. */
static int
compare_event_ids(const void *a, const void *b, void *arg)
{
	const Datum *ids = (const Datum *) arg;
	int			pa = *(const int *) a;
	int			pb = *(const int *) b;
	text	   *ta = DatumGetTextPP(ids[pa]);
	text	   *tb = DatumGetTextPP(ids[pb]);
	int			la = VARSIZE_ANY_EXHDR(ta);
	int			lb = VARSIZE_ANY_EXHDR(tb);
	int			cmp = memcmp(VARDATA_ANY(ta), VARDATA_ANY(tb), Min(la, lb));

	if (cmp != 0)
		return cmp;
	if (la != lb)
		return la < lb ? -1 : 1;
	return pa < pb ? -1 : pa > pb ? 1 : 0;
}

/*
 * Read the event_ids argument: a one-dimensional array (or an empty one)
 * whose every element is a valid event id.  All of it is checked before the
 * caller writes anything.  There is no cap on its length: the work is an
 * insertion or a probe per id, memory a few bytes per element beside the
 * array itself (which the server caps at 1 GB), and statement_timeout and
 * cancels are heard at every id.
 */
static void
event_batch_read(FunctionCallInfo fcinfo, int argno, EventBatch *batch)
{
	ArrayType  *array;
	bool	   *isnull;
	int			lower;
	int			n = 0;

	if (PG_ARGISNULL(argno))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("event_ids must not be null"),
				 errhint("Pass an empty array for no events.")));
	array = PG_GETARG_ARRAYTYPE_P(argno);
	if (ARR_NDIM(array) > 1)
		ereport(ERROR,
				(errcode(ERRCODE_ARRAY_SUBSCRIPT_ERROR),
				 errmsg("event_ids must be a one-dimensional array"),
				 errdetail("It has %d dimensions.", ARR_NDIM(array))));

	deconstruct_array(array, TEXTOID, -1, false, TYPALIGN_INT,
					  &batch->ids, &isnull, &batch->nids);
	lower = ARR_NDIM(array) == 1 ? ARR_LBOUND(array)[0] : 1;
	for (int i = 0; i < batch->nids; i++)
	{
		int			subscript = lower + i;

		idem_check_identifier(isnull[i] ? NULL : DatumGetTextPP(batch->ids[i]), 1,
							  "event_ids", &subscript);
	}

	batch->order = palloc(sizeof(int) * Max(batch->nids, 1));
	batch->answer = palloc0(sizeof(bool) * Max(batch->nids, 1));
	for (int i = 0; i < batch->nids; i++)
		batch->order[i] = i;
	qsort_arg(batch->order, batch->nids, sizeof(int), compare_event_ids, batch->ids);

	/* keep the first occurrence of each id: the first of its run */
	for (int i = 0; i < batch->nids; i++)
	{
		if (n > 0)
		{
			text	   *last = DatumGetTextPP(batch->ids[batch->order[n - 1]]);
			text	   *next = DatumGetTextPP(batch->ids[batch->order[i]]);

			if (VARSIZE_ANY_EXHDR(last) == VARSIZE_ANY_EXHDR(next) &&
				memcmp(VARDATA_ANY(last), VARDATA_ANY(next), VARSIZE_ANY_EXHDR(next)) == 0)
				continue;
		}
		batch->order[n++] = batch->order[i];
	}
	batch->ndistinct = n;
}


/* Bytewise, as compare_event_ids, for the search of a returned id. */
static int
compare_id_to_position(const void *key, const void *member, void *arg)
{
	const Datum *ids = (const Datum *) arg;
	text	   *ta = (text *) key;
	text	   *tb = DatumGetTextPP(ids[*(const int *) member]);
	int			la = VARSIZE_ANY_EXHDR(ta);
	int			lb = VARSIZE_ANY_EXHDR(tb);
	int			cmp = memcmp(VARDATA_ANY(ta), VARDATA_ANY(tb), Min(la, lb));

	if (cmp != 0)
		return cmp;
	return la < lb ? -1 : la > lb ? 1 : 0;
}

/* Set the answer of each id in the first column of SPI_tuptable's rows. */
static void
event_batch_take_answers(EventBatch *batch, uint64 nrows)
{
	for (uint64 r = 0; r < nrows; r++)
	{
		bool		isnull;
		Datum		id = SPI_getbinval(SPI_tuptable->vals[r], SPI_tuptable->tupdesc, 1,
									   &isnull);
		const int  *found;

		if (isnull)
			continue;
		found = bsearch_arg(DatumGetTextPP(id), batch->order, batch->ndistinct,
							sizeof(int), compare_id_to_position, batch->ids);
		if (found != NULL)
			batch->answer[*found] = true;
	}
}

/* The batch look: the ids among the batch's that the consumer has processed. */
static void
event_batch_look(EventBatch *batch, text *consumer)
{
	EventSql	context;
	Datum	   *sorted = palloc(sizeof(Datum) * batch->ndistinct);
	Datum		ids;

	for (int i = 0; i < batch->ndistinct; i++)
		sorted[i] = batch->ids[batch->order[i]];
	ids = PointerGetDatum(construct_array(sorted, batch->ndistinct, TEXTOID, -1, false,
										  TYPALIGN_INT));
	event_sql_begin(&context, consumer, AccessShareLock, "idem_is_processed_batch()");
	event_batch_take_answers(batch, event_sql_run(&context, EV_LOOK_BATCH, consumer, ids,
												  GetCurrentTimestamp(), 0));
	event_sql_end(&context);
}

/*
 * Mark each distinct id of the batch, in its bytewise order, with the
 * table opened once.  Each id's work runs in a context reset after it, so
 * that a long batch does not keep every probe's copies until it ends.
 */
static void
event_batch_mark(EventBatch *batch, text *consumer, const Interval *retention)
{
	IdemRelation rel;
	MemoryContext per_event = AllocSetContextCreate(CurrentMemoryContext,
													"idempotency batch event",
													ALLOCSET_SMALL_SIZES);
	bool		assume_new = true;
	MarkClock	clock = {false};

	idem_relation_open(&rel, IDEM_TABLE_EVENTS, RowExclusiveLock, consumer,
					   "idem_mark_processed_batch()");
	idem_batch_begin(&rel);
	for (int i = 0; i < batch->ndistinct; i++)
	{
		int			pos = batch->order[i];
		text	   *event_id = DatumGetTextPP(batch->ids[pos]);
		MemoryContext oldcontext;

		CHECK_FOR_INTERRUPTS();
		oldcontext = MemoryContextSwitchTo(per_event);
		batch->answer[pos] = mark_event(&rel, consumer, event_id, retention,
										&assume_new, &clock);
		MemoryContextSwitchTo(oldcontext);
		MemoryContextReset(per_event);
	}
	idem_batch_end(&rel);
	idem_relation_close(&rel);
	MemoryContextDelete(per_event);
}

/*
 * Answer for each distinct id of the batch by marking it (mark) or looking
 * it up; then return the ids answered true, in the array's order, as the
 * function's set of text.
 */
static void
event_batch_answer(FunctionCallInfo fcinfo, EventBatch *batch, text *consumer,
				   bool mark, const Interval *retention)
{
	ReturnSetInfo *rsinfo;

	InitMaterializedSRF(fcinfo, MAT_SRF_USE_EXPECTED_DESC);
	rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;

	if (batch->ndistinct > 0 && mark)
		event_batch_mark(batch, consumer, retention);
	else if (batch->ndistinct > 0)
		event_batch_look(batch, consumer);

	for (int i = 0; i < batch->nids; i++)
	{
		bool		isnull = false;

		if (batch->answer[i])
			tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc,
								 &batch->ids[i], &isnull);
	}
}

/*
 * idem_mark_processed_batch(consumer, event_ids, retention) -> SETOF text
 *
 * The ids that are new to the consumer (each processed once: return them to
 * the handler), in the array's order, each once however often it appears.
 * Each id is marked as idem_mark_processed would, in bytewise order.
 */
Datum
idem_mark_processed_batch(PG_FUNCTION_ARGS)
{
	text	   *consumer = idem_arg_identifier(fcinfo, 0, "consumer", 1);
	EventBatch	batch;
	Interval   *retention;

	event_batch_read(fcinfo, 1, &batch);
	retention = idem_arg_duration(fcinfo, 2, "retention",
								  (int64) idem_event_retention_s * 1000);
	idem_require_writable("idem_mark_processed_batch()");
	event_batch_answer(fcinfo, &batch, consumer, true, retention);
	return (Datum) 0;
}

/*
 * idem_is_processed_batch(consumer, event_ids) -> SETOF text
 *
 * The ids the consumer has processed (a committed mark within its
 * retention), in the array's order, each once.  Only looks.
 */
Datum
idem_is_processed_batch(PG_FUNCTION_ARGS)
{
	text	   *consumer = idem_arg_identifier(fcinfo, 0, "consumer", 1);
	EventBatch	batch;

	event_batch_read(fcinfo, 1, &batch);
	event_batch_answer(fcinfo, &batch, consumer, false, NULL);
	return (Datum) 0;
}
