/*-------------------------------------------------------------------------
 *
 * publish.c
 *	  Publishing the outbox: each ready row's NOTIFY, logical message or
 *	  route function, committed with the row's "published" mark, so that the
 *	  worker publishes each row once (what reaches a consumer is the
 *	  route's to say: a NOTIFY only the listeners connected then).
 *
 * Three layers, bottom up:
 *
 *	- one batch of candidates in the current transaction, fast (a failure
 *	  aborts the batch) or carefully (a subtransaction per row, so that a
 *	  failing row has its attempt recorded and the others go out), and one
 *	  row alone (outbox_publish_batch, outbox_publish_row);
 *
 *	- the ways the next batch goes after a failure (see PublishWay in
 *	  infra/maintenance.h): publish_batch, publish_failed, publish_blame, and
 *	  publish_fast_then_carefully, which idem_run_maintenance runs in
 *	  subtransactions of the caller's transaction;
 *
 *	- the worker's publishing, each batch in a transaction of its own
 *	  (publish_all, publish_if_woken).
 *
 * Which errors are a row's fault and which are not (a cancel, a shutdown,
 * no memory) is decided in one place, outbox_error_counts_against_row.
 * What wakes the worker when a commit enqueued rows of a routed topic is
 * infra/shmem.c's commit callback.
 *
 * Owns: the candidates, the route targets, the failed attempts' records.
 * May call: infra/maintenance.h (the cursor), infra/worker_xact.h,
 *	  outbox/outbox_sql.h (the outbox's statements), tables/ (whether Citus
 *	  distributes it), infra/
 *	  (settings, counters, run_as, subtransactions).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/htup_details.h"
#include "access/tupconvert.h"
#include "access/xact.h"
#include "catalog/namespace.h"
#include "catalog/pg_class.h"
#include "catalog/pg_proc.h"
#include "catalog/pg_type.h"
#include "commands/async.h"
#include "executor/spi.h"
#include "miscadmin.h"
#include "pgstat.h"
#include "replication/message.h"
#include "storage/latch.h"
#include "utils/acl.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/datum.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/regproc.h"
#include "utils/resowner.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"
#include "utils/typcache.h"

#include "infra/maintenance.h"
#include "outbox/publish.h"
#include "infra/worker_xact.h"
#include "compat.h"
#include "outbox/outbox_sql.h"
#include "tables/tables.h"
#include "infra/guc.h"
#include "infra/run_as.h"
#include "infra/shmem.h"
#include "infra/subxact.h"

/* A NOTIFY payload must be shorter than 8000 bytes. */
#define NOTIFY_PAYLOAD_LIMIT	7999

/* One candidate row, copied out of SPI's result before more SQL runs. */
typedef struct Candidate
{
	int64		id;
	Datum		event;			/* the row, as an idempotency.outbox composite */
	char	   *target;
	char	   *destination;
	Oid			run_as;			/* function target: the role it runs as */
	char	   *message;
	char	   *reference;
	bool		has_previous;
	int64		previous_id;
} Candidate;

static char *
candidate_text(HeapTuple tuple, TupleDesc desc, int column)
{
	char	   *value = SPI_getvalue(tuple, desc, column);

	return value != NULL ? pstrdup(value) : NULL;
}

static bool
published_earlier(const int64 *published, uint64 npublished, int64 id)
{
	for (uint64 i = 0; i < npublished; i++)
		if (published[i] == id)
			return true;
	return false;
}

/*
 * The outbox table as it is now: its OID and its storage (relfilenode), or
 * InvalidOid for both if it is gone.
 */
static void
outbox_identity(Oid *relid, Oid *relfilenode)
{
	Oid			schema = get_namespace_oid("idempotency", true);
	HeapTuple	tuple;

	*relid = OidIsValid(schema) ? get_relname_relid("outbox", schema) : InvalidOid;
	*relfilenode = InvalidOid;
	if (!OidIsValid(*relid))
		return;
	tuple = SearchSysCache1(RELOID, ObjectIdGetDatum(*relid));
	if (HeapTupleIsValid(tuple))
	{
		*relfilenode = ((Form_pg_class) GETSTRUCT(tuple))->relfilenode;
		ReleaseSysCache(tuple);
	}
}

/*
 * Call a route's function with the row, as the role that set the route (who
 * had to be allowed to execute it then, and still must be), with the
 * restrictions of a maintenance operation and the database's own
 * search_path rather than the pinned one our statements run under.  The
 * worker itself runs as the extension's owner: the function must not.
 *
 * The function must leave the outbox table where it found it: the batch
 * that calls it goes on in that table (the row's published mark, the other
 * rows of the batch).  Dropped from under the batch (DROP EXTENSION, DROP
 * SCHEMA, even if re-created), the batch's next statement would fail
 * outside the row's subtransaction and undo the attempt's record with the
 * rest, so that the row was tried again and again with its attempts at 0;
 * emptied (TRUNCATE, or any rewrite), the batch's rows that are not
 * published yet, and every other row, would be lost without a word.  So
 * either is the function's ERROR, which fails the row's attempt and undoes
 * what the function did.
 */
static void
call_route_function(const char *signature, Oid run_as, Datum event)
{
	Oid			funcoid = DatumGetObjectId(DirectFunctionCall1(regprocedurein,
															   CStringGetDatum(signature)));
	IdemRunAs	context;
	FmgrInfo	flinfo;
	Oid			relid_before;
	Oid			storage_before;
	Oid			relid_after;
	Oid			storage_after;
	LOCAL_FCINFO(fcinfo, 1);

	if (!OidIsValid(run_as) || !SearchSysCacheExists1(AUTHOID, ObjectIdGetDatum(run_as)))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_OBJECT),
				 errmsg("the role that routed to %s no longer exists", signature),
				 errhint("Set the route again with idem_outbox_route.")));
	if (compat_function_aclcheck(funcoid, run_as, ACL_EXECUTE) != ACLCHECK_OK)
		ereport(ERROR,
				(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
				 errmsg("role \"%s\" may no longer execute %s",
						GetUserNameFromId(run_as, false), signature)));

	idem_run_as_begin(&context, run_as,
					  SECURITY_LOCAL_USERID_CHANGE | SECURITY_RESTRICTED_OPERATION);
	fmgr_info(funcoid, &flinfo);
	InitFunctionCallInfoData(*fcinfo, &flinfo, 1, InvalidOid, NULL, NULL);
	fcinfo->args[0].value = event;
	fcinfo->args[0].isnull = false;
	outbox_identity(&relid_before, &storage_before);
	(void) FunctionCallInvoke(fcinfo);	/* its result, NULL or not, is ignored */
	idem_run_as_end(&context, false);

	/* what the function did, seen by the catalog lookups */
	CommandCounterIncrement();
	outbox_identity(&relid_after, &storage_after);
	if (relid_after != relid_before || storage_after != storage_before)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("route function %s %s table idempotency.outbox", signature,
						relid_after != relid_before ? "dropped" : "truncated or rewrote"),
				 errdetail("The rows are published in the transaction that calls the function, from that table."),
				 errhint("Change the function: it must not drop the extension, its schema or the outbox, nor truncate the outbox.")));
}

/*
 * Publish one row to its route.  Returns whether its NOTIFY went out
 * truncated: a payload of 8000 bytes or more is too long for NOTIFY, and
 * the row's reference goes instead, which tells the listener to read the
 * row by its id (the reference's "read"); publish_candidates then keeps the
 * row for idempotency.notify_truncated_retention.
 */
static bool
publish_one(const Candidate *candidate)
{
	/* idem_outbox_route never stores one, but the table's CHECK allows it */
	if (candidate->destination == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("the %s route of the row's topic has no destination", candidate->target),
				 errhint("Set the route again with idem_outbox_route.")));
	if (strcmp(candidate->target, "notify") == 0)
	{
		bool		truncated = strlen(candidate->message) > NOTIFY_PAYLOAD_LIMIT;

		Async_Notify(candidate->destination,
					 truncated ? candidate->reference : candidate->message);
		return truncated;
	}
	else if (strcmp(candidate->target, "logical") == 0)
		(void) compat_log_logical_message(candidate->destination, candidate->message,
										  strlen(candidate->message), true);
	else if (strcmp(candidate->target, "function") == 0)
		call_route_function(candidate->destination, candidate->run_as, candidate->event);
	else
		elog(ERROR, "unknown outbox route target \"%s\"", candidate->target);
	return false;
}

/*
 * Does an error that stopped a row's publication count against the row?  A
 * cancel, a shutdown and running out of memory do not: they say nothing of
 * the row, which is tried again as it was.  But only those of the server:
 * the server raises a cancel or a shutdown at an interrupt, in
 * ProcessInterrupts, while a route function that raises SQLSTATE 57014 or
 * 57P01 itself (RAISE ... USING ERRCODE = 'query_canceled') is failing like
 * any other, and were it let through, its row would be tried for ever with
 * its attempts at 0.
 */
static bool
outbox_error_counts_against_row(const ErrorData *error)
{
	if (error->sqlerrcode == ERRCODE_OUT_OF_MEMORY)
		return false;
	if (error->sqlerrcode == ERRCODE_QUERY_CANCELED ||
		error->sqlerrcode == ERRCODE_ADMIN_SHUTDOWN)
		return error->funcname == NULL || strcmp(error->funcname, "ProcessInterrupts") != 0;
	return true;
}

/* try_publish's work, in its subtransaction */
typedef struct RowPublication
{
	const Candidate *candidate;
	bool		truncated;
} RowPublication;

static void
publish_row_work(void *arg)
{
	RowPublication *row = arg;

	row->truncated = publish_one(row->candidate);
}

/*
 * Try to publish one row inside a subtransaction, so that a failure (an
 * ERROR in the user's function, most likely) undoes only this row's attempt;
 * a cancel, a shutdown or no memory is not the row's fault, and goes
 * through (see outbox_error_counts_against_row).  Returns NULL on success,
 * with *truncated set as publish_one says, or the error message.
 */
static char *
try_publish(const Candidate *candidate, bool *truncated)
{
	RowPublication row = {candidate, false};
	ErrorData  *error = idem_subxact_run(publish_row_work, &row, SUBXACT_RELEASE,
										 outbox_error_counts_against_row);

	*truncated = row.truncated;
	if (error == NULL)
		return NULL;
	return error->message != NULL ? error->message : pstrdup("unknown error");
}

/*
 * The candidates of a batch, in an array that grows as the statements return
 * them: what a batch holds is what is pending, however large the batch size
 * and however many topics are routed (the size is a limit per routed topic,
 * and allocating for it up front once asked for publish_batch_size times the
 * topics, over a gigabyte at the largest size and 1500 topics).
 */
typedef struct CandidateList
{
	Candidate  *items;
	uint64		count;
	uint64		capacity;
	MemoryContext context;
	bool		from_shard;		/* rows of a shard: events to convert */
} CandidateList;

/*
 * A copy of a shard's candidate row as an idempotency.outbox value, which a
 * route's function takes: a row of a shard (of a distributed outbox) is of
 * the shard's own row type, and its columns are matched by name, since the
 * table may keep dropped columns that its shards, made by Citus from its
 * definition, do not have.
 */
static Datum
event_as_outbox_row(Datum event)
{
	HeapTupleHeader header = DatumGetHeapTupleHeader(event);
	Oid			outbox_type = get_rel_type_id(get_relname_relid("outbox",
																get_namespace_oid("idempotency", false)));
	TupleDesc	shard_desc;
	TupleDesc	outbox_desc;
	TupleConversionMap *map;
	HeapTupleData row;
	HeapTuple	converted;
	Datum		copy;

	shard_desc = lookup_rowtype_tupdesc(HeapTupleHeaderGetTypeId(header),
										HeapTupleHeaderGetTypMod(header));
	outbox_desc = lookup_rowtype_tupdesc(outbox_type, -1);
	row.t_len = HeapTupleHeaderGetDatumLength(header);
	ItemPointerSetInvalid(&row.t_self);
	row.t_tableOid = InvalidOid;
	row.t_data = header;
	map = convert_tuples_by_name(shard_desc, outbox_desc);
	converted = map != NULL ? execute_attr_map_tuple(&row, map) : &row;
	copy = heap_copy_tuple_as_datum(converted, outbox_desc);
	ReleaseTupleDesc(outbox_desc);
	ReleaseTupleDesc(shard_desc);
	return copy;
}

/*
 * Append the rows of the last statement to the list, copying what the loop
 * needs out of SPI's result before more SQL runs, and free that result.
 */
static void
copy_candidates(uint64 count, CandidateList *list)
{
	TupleDesc	desc = SPI_tuptable->tupdesc;
	MemoryContext spi_context = MemoryContextSwitchTo(list->context);

	if (list->count + count > list->capacity)
	{
		uint64		capacity = Max(Max(list->capacity * 2, list->count + count), 16);

		list->items = list->items == NULL ?
			MemoryContextAllocHuge(list->context, sizeof(Candidate) * capacity) :
			repalloc_huge(list->items, sizeof(Candidate) * capacity);
		list->capacity = capacity;
	}
	for (uint64 i = 0; i < count; i++)
	{
		HeapTuple	tuple = SPI_tuptable->vals[i];
		Candidate  *candidate = &list->items[list->count++];
		bool		isnull;

		candidate->event = SPI_getbinval(tuple, desc, CANDIDATE_EVENT, &isnull);
		candidate->event = list->from_shard ? event_as_outbox_row(candidate->event) :
			datumCopy(candidate->event, false, -1);
		candidate->id = DatumGetInt64(SPI_getbinval(tuple, desc, CANDIDATE_ID, &isnull));
		candidate->target = candidate_text(tuple, desc, CANDIDATE_TARGET);
		candidate->destination = candidate_text(tuple, desc, CANDIDATE_DESTINATION);
		candidate->run_as = DatumGetObjectId(SPI_getbinval(tuple, desc, CANDIDATE_RUN_AS, &isnull));
		if (isnull)
			candidate->run_as = InvalidOid;
		candidate->message = candidate_text(tuple, desc, CANDIDATE_MESSAGE);
		candidate->reference = candidate_text(tuple, desc, CANDIDATE_REFERENCE);
		candidate->previous_id = DatumGetInt64(SPI_getbinval(tuple, desc, CANDIDATE_PREVIOUS_ID,
															  &isnull));
		candidate->has_previous = !isnull;
	}
	MemoryContextSwitchTo(spi_context);
	/* the next topic's rows must not pile up on top of these */
	SPI_freetuptable(SPI_tuptable);
}

/* Record a failed attempt of a pending row: backoff, or dead. */
static void
record_failed_attempt(int64 id, const char *error, TimestampTz now)
{
	Datum		values[6];

	values[0] = Int64GetDatum(id);
	values[1] = CStringGetTextDatum(error);
	values[2] = TimestampTzGetDatum(now);
	values[3] = Int32GetDatum(idem_outbox_max_attempts);
	values[4] = Int32GetDatum(idem_outbox_backoff_min_ms);
	values[5] = Int32GetDatum(Max(idem_outbox_backoff_min_ms, idem_outbox_backoff_max_ms));
	outbox_sql_run(STMT_PUBLISH_FAILED, values, NULL);
}

/*
 * Mark published the rows of published[] whose truncated[] entry equals
 * truncated_ones (all of them if truncated[] is NULL).  A row whose NOTIFY
 * went out truncated is kept, marked for the purge (see
 * STMT_MARK_PUBLISHED_TRUNCATED); the others are deleted, or kept for
 * outbox_retention.
 */
static void
mark_published(const int64 *published, const bool *truncated, uint64 npublished,
			   bool truncated_ones, TimestampTz now)
{
	Datum	   *ids = palloc(sizeof(Datum) * npublished);
	int			nids = 0;
	Datum		values[2];

	for (uint64 i = 0; i < npublished; i++)
		if (truncated == NULL || truncated[i] == truncated_ones)
			ids[nids++] = Int64GetDatum(published[i]);
	values[0] = PointerGetDatum(construct_array(ids, nids, INT8OID,
												sizeof(int64), FLOAT8PASSBYVAL,
												TYPALIGN_DOUBLE));
	values[1] = TimestampTzGetDatum(now);
	outbox_sql_run(truncated_ones ? STMT_MARK_PUBLISHED_TRUNCATED :
				   idem_outbox_retention_s == 0 ?
				   STMT_MARK_PUBLISHED_DELETE : STMT_MARK_PUBLISHED_KEEP,
				   values, NULL);
	pfree(ids);
}

/*
 * Publish the candidates, in the current transaction (see
 * outbox_publish_batch), and mark those published.  *started, if given, is
 * set before the first publication begins.
 */
static void
publish_candidates(const CandidateList *list, TimestampTz now, bool careful,
				   volatile bool *started, uint64 *published_count, uint64 *failed_count)
{
	int64	   *published = MemoryContextAllocHuge(list->context,
												   sizeof(int64) * Max(list->count, 1));
	uint64		npublished = 0;
	bool	   *truncated = MemoryContextAllocHuge(list->context,
												   sizeof(bool) * Max(list->count, 1));
	uint64		ntruncated = 0;

	for (uint64 i = 0; i < list->count; i++)
	{
		Candidate  *candidate = &list->items[i];
		char	   *error;

		CHECK_FOR_INTERRUPTS();

		/* an earlier row of its key is still unpublished: it waits */
		if (candidate->has_previous &&
			!published_earlier(published, npublished, candidate->previous_id))
			continue;

		/*
		 * The fast way publishes straight into the batch's transaction: an
		 * ERROR aborts the whole batch, nothing of it is published, and the
		 * caller tries again carefully.  The careful way gives each row a
		 * subtransaction, so that a failure undoes only that row's attempt.
		 */
		if (started != NULL)
			*started = true;
		if (careful)
			error = try_publish(candidate, &truncated[npublished]);
		else
		{
			truncated[npublished] = publish_one(candidate);
			error = NULL;
		}
		if (error == NULL)
		{
			ntruncated += truncated[npublished];
			published[npublished++] = candidate->id;
			continue;
		}

		ereport(LOG,
				(errmsg("idempotency: outbox row %lld could not be published to %s \"%s\": %s",
						(long long) candidate->id, candidate->target,
						candidate->destination != NULL ? candidate->destination : "",
						error)));
		record_failed_attempt(candidate->id, error, now);
		(*failed_count)++;
	}

	/*
	 * The rows whose NOTIFY went out truncated are kept, for the listener to
	 * read (see STMT_MARK_PUBLISHED_TRUNCATED), unless the window is 0; the
	 * others are deleted, or kept for outbox_retention.
	 */
	if (idem_notify_truncated_retention_s == 0)
		ntruncated = 0;
	if (ntruncated > 0)
		mark_published(published, truncated, npublished, true, now);
	if (npublished > ntruncated)
		mark_published(published, ntruncated > 0 ? truncated : NULL, npublished, false, now);
	*published_count = npublished;
}

/*
 * Where the walks of the worker's batches go on.  A batch's walk of a topic
 * reads the outbox_ready entries in id order; the rows published before
 * are deleted, but their entries are marked dead only by a vacuum, or by a
 * scan that finds the page unchanged since it read it (which, with a small
 * backlog, the enqueuers change all the time), and while a snapshot held
 * anywhere in the database may still see the rows, by nothing: a walk from
 * the topic's oldest entry would read them all in the heap, each batch
 * again (bench/README.md).  So:
 *
 * - A batch's walk of a topic goes on after the last id the walk of the
 *   round's last committed batch looked at, on the same shard; "" stands
 *   for the walk across the topics without a route, when there is a default
 *   route.  The ids below it are published or left for later: a row whose
 *   key was held back, one locked by a relay, one whose transaction took its
 *   id before and committed after the walk.  A batch that fails leaves the
 *   points where they were, so that the careful batch that follows looks at
 *   the same rows.
 *
 * - A round's first walk of a routed topic starts at the topic's oldest row
 *   that is pending or leased (STMT_PUBLISH_OLDEST), looked for after where
 *   the last round's was (round_starts): below it, every row was published,
 *   or dead, or not committed yet when the last round looked.  The walk
 *   across the topics starts at the oldest such row of any topic not
 *   routed to none (STMT_PUBLISH_OLDEST_EXCEPT, topic by topic; from
 *   the last round's start on, STMT_PUBLISH_NEXT_EXCEPT): its index, the
 *   primary key, holds the published rows kept for outbox_retention as
 *   well, and from its first entry each round would read them all.
 *
 * - A commit that enqueues or requeues rows tells the worker the smallest of
 *   their ids (idem_take_enqueued_from), which it takes before each batch's
 *   snapshot: the points past it go back to it (before_batch).  A row
 *   committed late is walked by the next batch, not left for the next round,
 *   which a backlog could put off for long, with the rest of its key held
 *   back by it meanwhile.
 *
 * - Every idempotency.naptime, a round that a backlog keeps going starts
 *   its walks again at round_starts, for the rows held back or locked (the
 *   look for the oldest moves each start up past the rows published
 *   meanwhile); and a round that begins a naptime after the last that did
 *   walks from each topic's oldest entry, for what nothing tells of (a
 *   prepared transaction's commit, a row inserted by hand, an enqueue
 *   through another node of a Citus cluster).  Not from the oldest entry
 *   while a round goes on: it reads every row published since the last
 *   vacuum, and with a backlog that is more than the batches publish.
 */
typedef struct WalkPoint
{
	Oid			shard;			/* the shard walked, or InvalidOid: the table */
	int64		after;
	char		topic[FLEXIBLE_ARRAY_MEMBER];	/* "": the walk across the unrouted topics */
} WalkPoint;

static WalkPoint *
find_point(List *points, Oid shard, const char *topic)
{
	ListCell   *lc;

	foreach(lc, points)
	{
		WalkPoint  *point = lfirst(lc);

		if (point->shard == shard && strcmp(point->topic, topic) == 0)
			return point;
	}
	return NULL;
}

/* A point of the walk of topic on the cursor's shard, appended to *points. */
static WalkPoint *
add_point(MaintenanceCursor *cursor, List **points, const char *topic, int64 after)
{
	MemoryContext old = MemoryContextSwitchTo(cursor->alone.context);
	WalkPoint  *point = palloc(offsetof(WalkPoint, topic) + strlen(topic) + 1);

	point->shard = cursor->outbox_shard;
	point->after = after;
	strcpy(point->topic, topic);
	*points = lappend(*points, point);
	MemoryContextSwitchTo(old);
	return point;
}

/* The points of points at or past from go back to just before it. */
static void
lower_points(List *points, int64 from)
{
	ListCell   *lc;

	foreach(lc, points)
	{
		WalkPoint  *point = lfirst(lc);

		if (from <= point->after)
			point->after = from == PG_INT64_MIN ? PG_INT64_MIN : from - 1;
	}
}

/*
 * Before each of the worker's batches, ahead of its snapshot (see above):
 * the rows committed since the last batch are walked, if they are behind
 * where the walks go on; every naptime, a round that a backlog keeps going
 * walks again from its starts, for the rows held back or locked; and a
 * round that begins a naptime after the last that did walks from each
 * topic's oldest entry, for the rows nothing told of.
 */
static void
before_batch(MaintenanceCursor *cursor, bool round_begins)
{
	int64		from = idem_take_enqueued_from();
	TimestampTz now = GetCurrentTimestamp();

	if (round_begins &&
		TimestampDifferenceExceeds(cursor->oldest_walked_at, now, idem_naptime_ms))
	{
		list_free_deep(cursor->round_starts);
		cursor->round_starts = NIL;
		cursor->oldest_walked_at = now;
	}
	if (round_begins ||
		TimestampDifferenceExceeds(cursor->started_at, now, idem_naptime_ms))
	{
		list_free_deep(cursor->walked);
		cursor->walked = NIL;
		cursor->started_at = now;
	}
	lower_points(cursor->walked, from);
	lower_points(cursor->round_starts, from);
}

/*
 * Where this batch's walk of topic goes on (see above); for "", the walk
 * across the topics but unrouted, those routed to none.
 */
static int64
walk_after(MaintenanceCursor *cursor, const char *topic, Datum unrouted)
{
	WalkPoint  *point = find_point(cursor->walked, cursor->outbox_shard, topic);
	Datum		values[2];
	bool		across = topic[0] == '\0';

	if (point != NULL)
		return point->after;

	/* the round's first walk of the topic */
	point = find_point(cursor->round_starts, cursor->outbox_shard, topic);
	if (point == NULL)
		point = add_point(cursor, &cursor->round_starts, topic, PG_INT64_MIN);
	values[0] = across ? unrouted : CStringGetTextDatum(topic);
	values[1] = Int64GetDatum(point->after);
	if (outbox_sql_run(!across ? STMT_PUBLISH_OLDEST :
					   point->after == PG_INT64_MIN ? STMT_PUBLISH_OLDEST_EXCEPT :
					   STMT_PUBLISH_NEXT_EXCEPT, values, NULL) == 1)
	{
		bool		isnull;
		Datum		oldest = SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1,
										   &isnull);

		/*
		 * the walk across the topics: NULL in an empty outbox, or where
		 * the look for the oldest gave up (too many topics)
		 */
		if (!isnull)
			point->after = DatumGetInt64(oldest) - 1;
	}
	return point->after;
}

/* The walk of topic, after after, read list's candidates from first on. */
static void
note_walk(MaintenanceCursor *cursor, const char *topic, int64 after,
		  const CandidateList *list, uint64 first)
{
	/* the candidates come in id order */
	(void) add_point(cursor, &cursor->walking, topic,
					 list->count > first ? list->items[list->count - 1].id : after);
}

/* The batch under way committed (keep: where its walks stopped counts) or failed. */
static void
end_walks(MaintenanceCursor *cursor, bool keep)
{
	if (keep && cursor->walking != NIL)
	{
		list_free_deep(cursor->walked);
		cursor->walked = cursor->walking;
	}
	else
		list_free_deep(cursor->walking);
	cursor->walking = NIL;
}

/*
 * Publish up to limit ready rows, in the current transaction: each row's
 * publication (NOTIFY, logical message, or the function's work) commits
 * together with the row's removal or its "published" mark, so that it
 * is published once even if the server stops in between.  Carefully,
 * each row in a subtransaction of its own, rows whose route fails are
 * recorded and retried later with backoff, held back with the rest of their
 * key; otherwise a failure raises the ERROR and the caller retries
 * carefully.  limit applies to each routed topic when there is no default
 * route.  Returns the number of candidates looked at (limit means there may
 * be more); *published and *failed say what came of them.  With tried, the
 * candidates' ids are left there, in tried_context, which must outlive the
 * transaction: if the batch fails all the same (the function got away with
 * something that makes the batch fail after its subtransaction, or at
 * commit), the caller publishes them one by one (outbox_publish_row).
 */
static uint64
outbox_publish_batch(Oid shard, TimestampTz now, int limit, bool careful,
					 uint64 *published_count, uint64 *failed_count,
					 OutboxRowIds *tried, MaintenanceCursor *cursor)
{
	OutboxSqlContext context;
	Datum		values[4];
	CandidateList list = {NULL, 0, 0, CurrentMemoryContext, OidIsValid(shard)};

	*published_count = *failed_count = 0;
	if (tried != NULL)
		tried->count = 0;
	if (!outbox_sql_begin_on(&context, shard))
		return 0;				/* the shard moved away */

	/*
	 * Which topics to look at: with no default route (or a default of none),
	 * only the routed ones; otherwise all but those routed to none.  Without
	 * any routed topic there is nothing to do, and nothing to scan.
	 */
	{
		uint64		nroutes = outbox_sql_run(STMT_ROUTES, NULL, NULL);
		OutboxRoutes routes;
		Datum	   *routed = palloc(sizeof(Datum) * Max(nroutes, 1));
		Datum	   *unrouted = palloc(sizeof(Datum) * Max(nroutes, 1));
		int			nrouted = 0;
		int			nunrouted = 0;

		outbox_routes_read(nroutes, &routes);
		for (int i = 0; i < routes.nroutes; i++)
		{
			if (routes.routes[i].routed)
				routed[nrouted++] = CStringGetTextDatum(routes.routes[i].topic);
			else
				unrouted[nunrouted++] = CStringGetTextDatum(routes.routes[i].topic);
		}
		if (!routes.default_routed && nrouted == 0)
		{
			outbox_sql_end(&context);
			return 0;
		}
		values[0] = TimestampTzGetDatum(now);
		values[1] = Int32GetDatum(limit);
		if (routes.default_routed)
		{
			Datum		none = PointerGetDatum(construct_array(unrouted, nunrouted, TEXTOID,
															   -1, false, TYPALIGN_INT));
			int64		after = walk_after(cursor, "", none);

			values[2] = none;
			values[3] = Int64GetDatum(after);
			copy_candidates(outbox_sql_run(STMT_PUBLISH_CANDIDATES_EXCEPT, values, NULL),
							&list);
			note_walk(cursor, "", after, &list, 0);
		}
		else
		{
			for (int t = 0; t < nrouted; t++)
			{
				const char *topic = TextDatumGetCString(routed[t]);
				uint64		first = list.count;
				int64		after = walk_after(cursor, topic, (Datum) 0);

				values[2] = routed[t];
				values[3] = Int64GetDatum(after);
				copy_candidates(outbox_sql_run(STMT_PUBLISH_CANDIDATES_TOPIC, values, NULL),
								&list);
				note_walk(cursor, topic, after, &list, first);
			}
		}
	}

	if (tried != NULL && list.count > 0)
	{
		if (list.count > tried->capacity)
		{
			if (tried->ids != NULL)
				pfree(tried->ids);
			tried->ids = MemoryContextAllocHuge(tried->context, sizeof(int64) * list.count);
			tried->capacity = list.count;
		}
		for (uint64 i = 0; i < list.count; i++)
			tried->ids[i] = list.items[i].id;
		tried->count = list.count;
	}

	publish_candidates(&list, now, careful, NULL, published_count, failed_count);
	outbox_sql_end(&context);
	return list.count;
}

/*
 * Publish one row, by id, carefully, in the current transaction, if it is
 * still a candidate and no earlier row of its key is unpublished: one of the
 * rows of a careful batch that failed as a whole, each given a transaction
 * of its own.  *started is set once its publication begins: a failure of the
 * transaction before that is not the row's (see outbox_record_failure).
 * Returns whether it was a candidate.
 */
static bool
outbox_publish_row(Oid shard, TimestampTz now, int64 id, volatile bool *started,
				   uint64 *published_count, uint64 *failed_count)
{
	OutboxSqlContext context;
	Datum		values[3];
	CandidateList list = {NULL, 0, 0, CurrentMemoryContext, OidIsValid(shard)};

	*published_count = *failed_count = 0;
	*started = false;
	if (!outbox_sql_begin_on(&context, shard))
		return false;
	values[0] = TimestampTzGetDatum(now);
	values[1] = Int32GetDatum(1);
	values[2] = Int64GetDatum(id);
	copy_candidates(outbox_sql_run(STMT_PUBLISH_CANDIDATE_ROW, values, NULL), &list);
	publish_candidates(&list, now, true, started, published_count, failed_count);
	outbox_sql_end(&context);
	return list.count > 0;
}

/*
 * Record a failed attempt of a row whose own transaction failed (see
 * outbox_publish_row), in a transaction that has not tried to publish it:
 * its attempts count up, with the error, a backoff, and after
 * idempotency.outbox_max_attempts, dead.  Returns whether the row was still
 * pending.
 */
static bool
outbox_record_failure(Oid shard, TimestampTz now, int64 id, const char *error)
{
	OutboxSqlContext context;
	bool		recorded;

	ereport(LOG,
			(errmsg("idempotency: outbox row %lld could not be published: its transaction failed: %s",
					(long long) id, error)));
	if (!outbox_sql_begin_on(&context, shard))
		return false;
	record_failed_attempt(id, error, now);
	recorded = SPI_processed > 0;
	outbox_sql_end(&context);
	return recorded;
}

/*
 * ---------------------------------------------------------------------
 * The ways a batch goes, for the worker and idem_run_maintenance()
 * ---------------------------------------------------------------------
 */

/*
 * Which outbox the next batch works on (cursor->outbox_shard): the table
 * (InvalidOid), or, where Citus distributes it, this node's shards of it in
 * turn, each until it has nothing ready; a batch that failed goes on
 * carefully, then row by row, on its shard.  False once every shard has had
 * its turn: the next round starts again at the first.
 *
 * The shards are read from Citus's catalogs once a round, not for each
 * batch: a shard that moves away meanwhile is skipped when its batch finds
 * it gone (outbox_sql_begin_on), and one that comes has its turn in the
 * next round.
 */
static bool
publish_target(MaintenanceCursor *cursor)
{
	if (!idem_table_distributed(IDEM_TABLE_OUTBOX))
	{
		cursor->outbox_shard = InvalidOid;
		return true;
	}
	if (cursor->publish_way != PUBLISH_FAST && OidIsValid(cursor->outbox_shard))
		return true;
	if (cursor->noutbox_shards < 0)
	{
		List	   *shards = idem_table_parts(IDEM_TABLE_OUTBOX);
		ListCell   *lc;

		if (cursor->outbox_shards != NULL)
			pfree(cursor->outbox_shards);
		cursor->outbox_shards = MemoryContextAlloc(cursor->alone.context,
												   sizeof(Oid) * Max(list_length(shards), 1));
		cursor->noutbox_shards = 0;
		foreach(lc, shards)
			cursor->outbox_shards[cursor->noutbox_shards++] = lfirst_oid(lc);
	}
	if (cursor->outbox_part >= cursor->noutbox_shards)
	{
		cursor->outbox_part = 0;
		cursor->outbox_shard = InvalidOid;
		cursor->noutbox_shards = -1;
		return false;
	}
	cursor->outbox_shard = cursor->outbox_shards[cursor->outbox_part];
	return true;
}

/*
 * One publish batch, the way cursor->publish_way says (see PublishWay), in
 * the current transaction.  If it fails, the caller undoes the transaction
 * and calls publish_failed, which picks the next way.
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
	if (!publish_target(cursor))
		return false;
	if (way == PUBLISH_ALONE && cursor->alone_next < cursor->alone.count)
	{
		int64		id = cursor->alone.ids[cursor->alone_next++];

		(void) outbox_publish_row(cursor->outbox_shard, now, id, &cursor->alone_started,
								  &published, &failed);
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
		looked_at = outbox_publish_batch(cursor->outbox_shard, now, limit, careful,
										 &published, &failed,
										 careful ? &cursor->alone : NULL, cursor);
		cursor->publish_way = PUBLISH_FAST;
		more = looked_at >= (uint64) limit && (published > 0 || careful);
	}
	/* a shard done with, the next one's turn */
	if (!more && OidIsValid(cursor->outbox_shard) && cursor->publish_way == PUBLISH_FAST)
	{
		cursor->outbox_part++;
		more = true;
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
 * publish_blame in a transaction that has not tried to publish
 * it.  Once the rows alone are done, publishing goes on only if one of them
 * went out or had its failure recorded, so that a failure that is no row's
 * (one that comes before any row is tried) does not go round and round.
 */
static bool
publish_failed(MaintenanceCursor *cursor, const ErrorData *error, bool *blame)
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
 * Record the failed attempt of the row publish_failed blamed,
 * with the error its transaction failed with.  Returns whether it did (the
 * row may have stopped being pending meanwhile); if so, publishing may go on
 * at once.
 */
static bool
publish_blame(MaintenanceCursor *cursor, const char *error,
						  MaintenanceCounts *counts)
{
	int64		id = cursor->alone.ids[cursor->alone_next - 1];

	if (!outbox_record_failure(cursor->outbox_shard, GetCurrentTimestamp(), id,
							   error != NULL ? error : "unknown error"))
		return false;
	counts->publish_failures++;
	idem_count(IDEM_COUNTER_PUBLISH_FAILURES, 1);
	cursor->alone_progress = true;
	return true;
}

/* publish_fast_then_carefully's batch, in its subtransaction */
typedef struct CarefulBatch
{
	MaintenanceCursor *cursor;
	MaintenanceCounts *counts;
} CarefulBatch;

static void
publish_batch_work(void *arg)
{
	CarefulBatch *batch = arg;

	(void) publish_batch(batch->cursor, batch->counts);
}

/*
 * publish_fast_then_carefully's batch, and the ways it goes after a failure;
 * a cancel, a shutdown or no memory goes through.
 */
static void
publish_one_batch_carefully(MaintenanceCursor *cursor, MaintenanceCounts *counts)
{
	CarefulBatch batch = {cursor, counts};

	do
	{
		ErrorData  *error = idem_subxact_run(publish_batch_work, &batch, SUBXACT_RELEASE,
											 outbox_error_counts_against_row);
		bool		blame;

		end_walks(cursor, error == NULL);
		if (error == NULL)
			continue;
		(void) publish_failed(cursor, error, &blame);
		if (blame)
			(void) publish_blame(cursor, error->message, counts);
		FreeErrorData(error);
	} while (cursor->publish_way != PUBLISH_FAST);
}

/*
 * One publish batch for idem_run_maintenance (one on each of this node's
 * shards of a distributed outbox), the ways the worker goes (see
 * PublishWay), each in a subtransaction rather than a transaction of its
 * own: the fast way (up to publish_batch_size rows in one go); if it fails,
 * the careful way (at most 32 rows, each in a subtransaction of its own, so
 * the failing row is recorded and the others go out); and if even that
 * fails, each of its rows alone, a failing one's attempt recorded once its
 * subtransaction is undone.  A failure at the caller's commit is beyond
 * reach here: the worker, whose transactions these are, records it.
 */
void
publish_fast_then_carefully(MaintenanceCursor *cursor, MaintenanceCounts *counts)
{
	int			turns = 1;

	/* one batch of each of this node's shards of a distributed outbox */
	if (idem_table_distributed(IDEM_TABLE_OUTBOX))
		turns = list_length(idem_table_parts(IDEM_TABLE_OUTBOX));
	for (int turn = 0; turn < turns; turn++)
	{
		/* shard turn's batch, whether or not the one before had more */
		cursor->outbox_part = turn;
		cursor->publish_way = PUBLISH_FAST;
		publish_one_batch_carefully(cursor, counts);
	}
}

/*
 * ---------------------------------------------------------------------
 * The worker's publishing: each batch in a transaction of its own
 * ---------------------------------------------------------------------
 */

/* A publishing unit of work, for worker_run_unit. */
typedef struct PublishUnit
{
	MaintenanceCursor *cursor;
	MaintenanceCounts counts;	/* the worker's are not kept */
	const char *error;			/* blame_unit's */
	bool		began;			/* batch_unit's: it got past the extension's lock */
} PublishUnit;

/* blame_row's unit */
static bool
blame_unit(void *arg)
{
	PublishUnit *publish = arg;

	return publish_blame(publish->cursor, publish->error, &publish->counts);
}

/*
 * Record, in a transaction of its own, the failed attempt of the row whose
 * own transaction failed with error (see publish_failed): that
 * transaction's record of it was undone with the rest.  Returns whether it
 * was recorded.
 */
static bool
blame_row(MaintenanceCursor *cursor, const char *error)
{
	PublishUnit publish = {.cursor = cursor, .error = error};

	return worker_run_unit(NULL, WORKER_UNIT_SNAPSHOT | WORKER_UNIT_EXTENSION,
						   blame_unit, &publish, NULL);
}

/* run_publish_batch's unit */
static bool
batch_unit(void *arg)
{
	PublishUnit *publish = arg;

	publish->began = true;
	return publish_batch(publish->cursor, &publish->counts);
}

/*
 * One publish batch, in a transaction of its own, the way the cursor says
 * (see PublishWay).  An ERROR is reported, and the next way is tried at
 * once: a batch that failed the fast way is done again carefully, one that
 * failed carefully row by row, and a row that fails alone has its failed
 * attempt recorded in another transaction, so that no row is tried for
 * ever with its attempts at 0 while the database's other rows wait.  A
 * cancel, a shutdown or no memory stops publishing until the next round.
 * Returns whether another batch has work to do.
 */
static bool
run_publish_batch(MaintenanceCursor *cursor, bool round_begins)
{
	PublishUnit publish = {.cursor = cursor};
	ErrorData  *error;
	bool		more;
	bool		blame;

	before_batch(cursor, round_begins);
	more = worker_run_unit(maintenance_unit_names[UNIT_PUBLISH],
						   WORKER_UNIT_SNAPSHOT | WORKER_UNIT_EXTENSION,
						   batch_unit, &publish, &error);
	end_walks(cursor, error == NULL);

	if (error != NULL && !publish.began)
	{
		/*
		 * No row was tried (the extension was dropped meanwhile, most
		 * likely): no row is to blame, and the next way would fail the same,
		 * for ever, since only a batch moves the cursor on.  Stop until the
		 * next round, which looks for the extension first.
		 */
		cursor->publish_way = PUBLISH_FAST;
		more = false;
		FreeErrorData(error);
	}
	else if (error != NULL)
	{
		more = publish_failed(cursor, error, &blame);
		if (blame && blame_row(cursor, error->message))
			more = true;
		FreeErrorData(error);
	}

	pgstat_report_stat(false);
	return more;
}

/* Publish until nothing is ready. */
void
publish_all(MaintenanceCursor *cursor)
{
	bool		round_begins = true;

	while (run_publish_batch(cursor, round_begins))
	{
		CHECK_FOR_INTERRUPTS();
		round_begins = false;
	}
}

/* Publish now if a commit enqueued rows since we last looked. */
void
publish_if_woken(MaintenanceCursor *cursor)
{
	if (MyLatch->is_set)
	{
		ResetLatch(MyLatch);
		publish_all(cursor);
	}
}
