/*-------------------------------------------------------------------------
 *
 * outbox.c
 *	  The transactional outbox's SQL API: idem_outbox_enqueue, the routes,
 *	  and the pull API for external relays (fetch, ack, nack, requeue,
 *	  discard).
 *
 * Ordering.  Rows of one (topic, key) go out oldest first, gap-safe: a row
 * is never handed out while an earlier row of its key is unpublished
 * (pending, leased or dead).  Ids come from a sequence and are handed out
 * before commit, so an id alone says nothing about commit order: a poller
 * that takes "ids above the last one seen" skips rows that commit late.  We
 * avoid that in two parts:
 *
 *	- enqueuers of one (topic, key) are serialised: idem_outbox_enqueue takes
 *	  a transaction-scoped lock on the pair before the row gets its id, so a
 *	  later row of a key cannot get an id, let alone commit, before an
 *	  earlier one's transaction has ended.  Other keys never wait, however
 *	  long a transaction runs; rows without a key take no lock;
 *
 *	- readers never work from an id watermark: they take the head of each
 *	  key, the oldest unpublished row, and only if it is ready.
 *
 * The statements run through SPI as the owner of the extension's tables
 * (direct/outbox_sql.c); publishing, by the background worker or
 * idem_run_maintenance, is bgw/publish.c.
 *
 * Owns: the SQL functions idem_outbox_*, the per-key enqueue lock, and
 *	  this backend's knowledge of which topics are routed.
 * May call: direct/ (the outbox's statements and owner), infra/ (argument
 *	  checks, settings, the worker's wake-up at commit).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <ctype.h>

#include "access/htup_details.h"
#include "access/xact.h"
#include "catalog/namespace.h"
#include "catalog/pg_proc.h"
#include "catalog/pg_type.h"
#include "common/hashfn.h"
#include "executor/spi.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "storage/lmgr.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/jsonb.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/regproc.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"
#include "utils/tuplestore.h"

#include "compat.h"
#include "direct/outbox_sql.h"
#include "direct/tables.h"
#include "infra/args.h"
#include "infra/guc.h"
#include "infra/shmem.h"

PG_FUNCTION_INFO_V1(idem_outbox_enqueue);
PG_FUNCTION_INFO_V1(idem_outbox_route);
PG_FUNCTION_INFO_V1(idem_outbox_fetch);
PG_FUNCTION_INFO_V1(idem_outbox_ack);
PG_FUNCTION_INFO_V1(idem_outbox_nack);
PG_FUNCTION_INFO_V1(idem_outbox_requeue);
PG_FUNCTION_INFO_V1(idem_outbox_discard);

/*
 * The per-key enqueue lock is an advisory lock (it shows in pg_locks with
 * locktype "advisory") on a 64-bit hash of the pair, told apart from the
 * advisory locks of pg_advisory_lock() by this value in its last field
 * (objsubid).  A hash collision only makes two keys share a lock.
 */
#define OUTBOX_KEY_LOCK_CLASS	0x4944

/* The longest NOTIFY channel or logical message prefix we accept. */
#define ROUTE_NAME_MAX_BYTES	(NAMEDATALEN - 1)

/*
 * What this backend knows of the routes, so that an enqueue wakes the worker
 * only for a row the worker will publish: a wake-up costs the worker a
 * transaction, which at thousands of commits a second of topics that
 * external relays serve would be a core's worth of work for nothing.  Read
 * again whenever the database's routes version moves (each commit that
 * routes, and CREATE EXTENSION, move it).  Knowledge gone stale through a
 * direct write to outbox_routes costs no row: a row the worker was not woken
 * for goes out at its next naptime.
 */
typedef struct RoutesCache
{
	bool		valid;
	uint64		version;
	OutboxRoutes known;			/* by topic, in byte order (the column is "C") */
} RoutesCache;

static RoutesCache routes_cache;
static MemoryContext routes_context = NULL;

static int
compare_routes(const void *a, const void *b)
{
	return strcmp(((const OutboxRoute *) a)->topic, ((const OutboxRoute *) b)->topic);
}

/* Read the routes into routes_cache (see there). */
static void
load_routes(uint64 version)
{
	OutboxSqlContext context;
	MemoryContext old;

	routes_cache.valid = false;
	if (routes_context == NULL)
		routes_context = AllocSetContextCreate(TopMemoryContext, "idempotency routes",
											   ALLOCSET_SMALL_SIZES);
	MemoryContextReset(routes_context);

	/*
	 * Read with the latest snapshot, not the transaction's: under REPEATABLE
	 * READ, the transaction's could predate the version read by the caller,
	 * and what we keep would then pass for that version.
	 */
	outbox_sql_begin(&context);
	if (SPI_execute_snapshot(outbox_plan(STMT_ROUTES), NULL, NULL, GetLatestSnapshot(),
							 InvalidSnapshot, true, false, 0) != SPI_OK_SELECT)
		elog(ERROR, "could not read the outbox routes");
	old = MemoryContextSwitchTo(routes_context);
	outbox_routes_read(SPI_processed, &routes_cache.known);
	qsort(routes_cache.known.routes, routes_cache.known.nroutes, sizeof(OutboxRoute),
		  compare_routes);
	MemoryContextSwitchTo(old);
	outbox_sql_end(&context);

	/*
	 * This transaction's own route changes are in what we read, but they may
	 * yet roll back, without moving the version: keep them for this call only.
	 */
	routes_cache.version = version;
	routes_cache.valid = !idem_routes_changed_in_transaction();
}

/* Will the worker publish rows of this topic?  False without a worker. */
static bool
topic_is_routed(text *topic)
{
	uint64		version;
	OutboxRoute key;
	OutboxRoute *found;

	if (!idem_routes_version(&version))
		return false;
	if (!routes_cache.valid || routes_cache.version != version)
		load_routes(version);

	key.topic = text_to_cstring(topic);
	found = bsearch(&key, routes_cache.known.routes, routes_cache.known.nroutes,
					sizeof(OutboxRoute), compare_routes);
	pfree(key.topic);
	return found != NULL ? found->routed : routes_cache.known.default_routed;
}

/*
 * Serialise enqueuers of one (topic, key) until the end of the transaction.
 */
static void
lock_outbox_key(text *topic, text *key)
{
	uint64		hash;
	LOCKTAG		tag;

	hash = hash_bytes_extended((const unsigned char *) VARDATA_ANY(topic),
							   VARSIZE_ANY_EXHDR(topic), 0);
	hash = hash_bytes_extended((const unsigned char *) VARDATA_ANY(key),
							   VARSIZE_ANY_EXHDR(key), hash);
	SET_LOCKTAG_ADVISORY(tag, MyDatabaseId, (uint32) (hash >> 32), (uint32) hash,
						 OUTBOX_KEY_LOCK_CLASS);
	(void) LockAcquire(&tag, ExclusiveLock, false, false);
}

/*
 * idem_outbox_enqueue(topic, payload, key, headers) -> bigint
 */
Datum
idem_outbox_enqueue(PG_FUNCTION_ARGS)
{
	text	   *topic = idem_arg_identifier(fcinfo, 0, "topic", 1);
	text	   *key = PG_ARGISNULL(2) ? NULL : idem_arg_identifier(fcinfo, 2, "key", 1);
	Jsonb	   *headers = PG_ARGISNULL(3) ? NULL : PG_GETARG_JSONB_P(3);
	TimestampTz now = GetCurrentTimestamp();
	IdemRelation rel;
	Datum		values[Natts_outbox];
	bool		nulls[Natts_outbox];
	int64		id;

	if (VARSIZE_ANY_EXHDR(topic) == 1 && *VARDATA_ANY(topic) == '*')
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("\"*\" is not a topic"),
				 errdetail("\"*\" names the default route in idem_outbox_route.")));
	if (PG_ARGISNULL(1))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("payload must not be null")));
	if (headers != NULL && !JB_ROOT_IS_OBJECT(headers))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("headers must be a JSON object")));

	idem_require_writable("idem_outbox_enqueue()");

	/*
	 * A new row is written straight into the table and its indexes, as the
	 * key functions write theirs (see tables.c): no executor, no SPI.
	 */
	idem_relation_open(&rel, IDEM_TABLE_OUTBOX, RowExclusiveLock);

	/* before the row gets its id: see the top of this file */
	if (key != NULL)
		lock_outbox_key(topic, key);
	id = idem_outbox_next_id();

	memset(nulls, false, sizeof(nulls));
	values[Anum_outbox_id - 1] = Int64GetDatum(id);
	values[Anum_outbox_topic - 1] = PointerGetDatum(topic);
	values[Anum_outbox_key - 1] = PointerGetDatum(key);
	nulls[Anum_outbox_key - 1] = key == NULL;
	values[Anum_outbox_payload - 1] = PG_GETARG_DATUM(1);
	values[Anum_outbox_headers - 1] = PointerGetDatum(headers);
	nulls[Anum_outbox_headers - 1] = headers == NULL;
	values[Anum_outbox_created_at - 1] = TimestampTzGetDatum(now);
	values[Anum_outbox_state - 1] = CStringGetTextDatum("pending");
	values[Anum_outbox_attempts - 1] = Int32GetDatum(0);
	values[Anum_outbox_available_at - 1] = TimestampTzGetDatum(now);
	nulls[Anum_outbox_last_error - 1] = true;
	nulls[Anum_outbox_published_at - 1] = true;

	idem_insert(&rel, values, nulls);
	idem_relation_close(&rel);
	if (topic_is_routed(topic))
		idem_wake_worker_at_commit();

	PG_RETURN_INT64(id);
}

/* A NOTIFY channel or logical message prefix: 1 to 63 bytes, no spaces. */
static void
check_route_name(const char *target, const char *name)
{
	size_t		len = strlen(name);
	bool		ok = len >= 1 && len <= ROUTE_NAME_MAX_BYTES;

	for (const char *p = name; ok && *p != '\0'; p++)
		ok = !isspace((unsigned char) *p) && !iscntrl((unsigned char) *p);
	if (!ok)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("\"%s\" is not a valid %s", name,
						strcmp(target, "notify") == 0 ? "channel name" : "message prefix"),
				 errdetail("A %s is 1 to %d bytes, without white space or control characters.",
						   strcmp(target, "notify") == 0 ? "channel name" : "message prefix",
						   ROUTE_NAME_MAX_BYTES)));
}

/*
 * Resolve a function target: a name, or a signature, of a function that
 * takes one idempotency.outbox row.  Returns it in the qualified form the
 * route stores.
 */
static char *
resolve_route_function(const char *destination)
{
	Oid			rowtype;
	char	   *signature;
	Oid			funcoid;
	HeapTuple	proctup;
	Form_pg_proc proc;
	bool		takes_one_row;
	AclResult	aclresult;

	rowtype = get_rel_type_id(get_relname_relid("outbox",
												get_namespace_oid("idempotency", false)));

	/* a bare name means the overload that takes an outbox row */
	signature = strchr(destination, '(') != NULL ? pstrdup(destination) :
		psprintf("%s(idempotency.outbox)", destination);
	funcoid = DatumGetObjectId(DirectFunctionCall1(regprocedurein,
												   CStringGetDatum(signature)));

	proctup = SearchSysCache1(PROCOID, ObjectIdGetDatum(funcoid));
	if (!HeapTupleIsValid(proctup))
		elog(ERROR, "cache lookup failed for function %u", funcoid);
	proc = (Form_pg_proc) GETSTRUCT(proctup);
	takes_one_row = proc->pronargs == 1 && proc->proargtypes.values[0] == rowtype;
	if (proc->prokind != PROKIND_FUNCTION)
		ereport(ERROR,
				(errcode(ERRCODE_WRONG_OBJECT_TYPE),
				 errmsg("%s is not a function", format_procedure_qualified(funcoid)),
				 errhint("Route to a plain function that takes one idempotency.outbox row.")));
	ReleaseSysCache(proctup);
	if (!takes_one_row)
		ereport(ERROR,
				(errcode(ERRCODE_DATATYPE_MISMATCH),
				 errmsg("function %s does not take one idempotency.outbox row",
						format_procedure_qualified(funcoid)),
				 errhint("Declare it as f(event idempotency.outbox).")));

	aclresult = compat_function_aclcheck(funcoid, GetUserId(), ACL_EXECUTE);
	if (aclresult != ACLCHECK_OK)
		aclcheck_error(aclresult, OBJECT_FUNCTION, format_procedure_qualified(funcoid));

	return format_procedure_qualified(funcoid);
}

/*
 * idem_outbox_route(topic, target, destination) -> void
 *
 * Targets: notify (destination: the channel, by default
 * "idempotency_outbox"), logical (the message prefix, by default
 * "idempotency.outbox"), function (required: a function taking one
 * idempotency.outbox row) and none (no destination: an external relay uses
 * the pull API).  Topic "*" sets the default route.
 */
Datum
idem_outbox_route(PG_FUNCTION_ARGS)
{
	text	   *topic = idem_arg_identifier(fcinfo, 0, "topic", 1);
	char	   *target;
	char	   *destination = PG_ARGISNULL(2) ? NULL : text_to_cstring(PG_GETARG_TEXT_PP(2));
	Datum		values[4];
	char		nulls[4] = {' ', ' ', ' ', 'n'};
	OutboxSqlContext context;

	if (PG_ARGISNULL(1))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("target must not be null")));
	target = text_to_cstring(PG_GETARG_TEXT_PP(1));

	if (strcmp(target, "notify") == 0 || strcmp(target, "logical") == 0)
	{
		if (destination == NULL)
			destination = pstrdup(strcmp(target, "notify") == 0 ?
								  "idempotency_outbox" : "idempotency.outbox");
		check_route_name(target, destination);
	}
	else if (strcmp(target, "function") == 0)
	{
		if (destination == NULL)
			ereport(ERROR,
					(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
					 errmsg("the function target needs a destination"),
					 errhint("Name a function that takes one idempotency.outbox row.")));
		destination = resolve_route_function(destination);
		/* the function will run as the role that routed to it */
		values[3] = ObjectIdGetDatum(GetUserId());
		nulls[3] = ' ';
	}
	else if (strcmp(target, "none") == 0)
	{
		if (destination != NULL)
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("the none target takes no destination")));
	}
	else
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("\"%s\" is not an outbox route target", target),
				 errhint("The targets are notify, logical, function and none.")));

	idem_require_writable("idem_outbox_route()");

	values[0] = PointerGetDatum(topic);
	values[1] = CStringGetTextDatum(target);
	values[2] = destination != NULL ? CStringGetTextDatum(destination) : (Datum) 0;
	nulls[2] = destination != NULL ? ' ' : 'n';

	outbox_sql_begin(&context);
	outbox_sql_run(STMT_ROUTE, values, nulls);
	outbox_sql_end(&context);
	idem_routes_changed_at_commit();

	PG_RETURN_VOID();
}

/*
 * idem_outbox_fetch(topic, batch, lease) -> SETOF idempotency.outbox
 */
Datum
idem_outbox_fetch(PG_FUNCTION_ARGS)
{
	text	   *topic = idem_arg_identifier(fcinfo, 0, "topic", 1);
	int32		batch;
	Interval   *lease;
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	Datum		values[5];
	OutboxSqlContext context;
	uint64		fetched;

	if (PG_ARGISNULL(1))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("batch must not be null")));
	batch = PG_GETARG_INT32(1);
	if (batch <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("batch must be positive"),
				 errdetail("The value given was %d.", batch)));
	if (PG_ARGISNULL(2))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("lease must not be null")));
	lease = idem_arg_duration(fcinfo, 2, "lease", 0);

	idem_require_writable("idem_outbox_fetch()");
	InitMaterializedSRF(fcinfo, MAT_SRF_USE_EXPECTED_DESC);

	values[0] = PointerGetDatum(topic);
	values[1] = Int32GetDatum(batch);
	values[2] = IntervalPGetDatum(lease);
	values[3] = TimestampTzGetDatum(GetCurrentTimestamp());
	values[4] = Int32GetDatum(idem_outbox_max_attempts);

	outbox_sql_begin(&context);
	fetched = outbox_sql_run(STMT_FETCH, values, NULL);
	for (uint64 i = 0; i < fetched; i++)
		tuplestore_puttuple(rsinfo->setResult, SPI_tuptable->vals[i]);
	outbox_sql_end(&context);

	return (Datum) 0;
}

/*
 * idem_outbox_ack(ids) -> integer: leased rows among ids, now published.
 */
Datum
idem_outbox_ack(PG_FUNCTION_ARGS)
{
	Datum		values[2];
	OutboxSqlContext context;
	uint64		acknowledged;

	if (PG_ARGISNULL(0))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("ids must not be null")));
	idem_require_writable("idem_outbox_ack()");

	values[0] = PG_GETARG_DATUM(0);
	values[1] = TimestampTzGetDatum(GetCurrentTimestamp());

	outbox_sql_begin(&context);
	acknowledged = outbox_sql_run(idem_outbox_retention_s == 0 ?
								  STMT_ACK_DELETE : STMT_ACK_KEEP,
								  values, NULL);
	outbox_sql_end(&context);

	PG_RETURN_INT32((int32) acknowledged);
}

/* The functions below act on one row by id, and say whether they did. */
static bool
change_one_row(OutboxStatement statement, Datum *values, const char *nulls,
			   const char *function_name)
{
	OutboxSqlContext context;
	uint64		changed;

	idem_require_writable(function_name);
	outbox_sql_begin(&context);
	changed = outbox_sql_run(statement, values, nulls);
	outbox_sql_end(&context);
	return changed > 0;
}

static int64
arg_row_id(FunctionCallInfo fcinfo)
{
	if (PG_ARGISNULL(0))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("id must not be null")));
	return PG_GETARG_INT64(0);
}

/*
 * idem_outbox_nack(id, error) -> boolean: false for a row not leased.
 */
Datum
idem_outbox_nack(PG_FUNCTION_ARGS)
{
	Datum		values[6];
	char		nulls[6] = {' ', ' ', ' ', ' ', ' ', ' '};

	values[0] = Int64GetDatum(arg_row_id(fcinfo));
	values[1] = PG_ARGISNULL(1) ? (Datum) 0 : PG_GETARG_DATUM(1);
	nulls[1] = PG_ARGISNULL(1) ? 'n' : ' ';
	values[2] = TimestampTzGetDatum(GetCurrentTimestamp());
	values[3] = Int32GetDatum(idem_outbox_max_attempts);
	values[4] = Int32GetDatum(idem_outbox_backoff_min_ms);
	values[5] = Int32GetDatum(Max(idem_outbox_backoff_min_ms, idem_outbox_backoff_max_ms));

	PG_RETURN_BOOL(change_one_row(STMT_NACK, values, nulls, "idem_outbox_nack()"));
}

/*
 * idem_outbox_requeue(id) -> boolean: a dead row is pending again, with its
 * attempts reset; false for a row that is not dead.
 */
Datum
idem_outbox_requeue(PG_FUNCTION_ARGS)
{
	Datum		values[2];

	values[0] = Int64GetDatum(arg_row_id(fcinfo));
	values[1] = TimestampTzGetDatum(GetCurrentTimestamp());
	PG_RETURN_BOOL(change_one_row(STMT_REQUEUE, values, NULL, "idem_outbox_requeue()"));
}

/*
 * idem_outbox_discard(id) -> boolean: a dead row is deleted; false for a
 * row that is not dead.
 */
Datum
idem_outbox_discard(PG_FUNCTION_ARGS)
{
	Datum		values[1];

	values[0] = Int64GetDatum(arg_row_id(fcinfo));
	PG_RETURN_BOOL(change_one_row(STMT_DISCARD, values, NULL, "idem_outbox_discard()"));
}
