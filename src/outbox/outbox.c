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
 * (outbox/outbox_sql.c); publishing, by the background worker or
 * idem_run_maintenance, is outbox/publish.c.
 *
 * Owns: the SQL functions idem_outbox_*, the per-key enqueue lock, and
 *	  this backend's knowledge of which topics are routed.
 * May call: outbox/outbox_sql.h and outbox/outbox_ack.h, tables/ (the
 *	  shard of a topic and the ids of an enqueue), infra/ (argument
 *	  checks, settings, the worker's wake-up at commit).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <ctype.h>

#include "access/htup_details.h"
#include "access/table.h"
#include "access/tupconvert.h"
#include "access/xact.h"
#include "catalog/namespace.h"
#include "catalog/pg_proc.h"
#include "catalog/pg_type.h"
#include "common/hashfn.h"
#include "executor/spi.h"
#include "funcapi.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "storage/lmgr.h"
#include "utils/acl.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/datum.h"
#include "utils/guc.h"
#include "utils/hsearch.h"
#include "utils/jsonb.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/regproc.h"
#include "utils/snapmgr.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"
#include "utils/tuplestore.h"

#include "compat.h"
#include "outbox/outbox_ack.h"
#include "outbox/outbox_sql.h"
#include "tables/tables.h"
#include "infra/args.h"
#include "infra/guc.h"
#include "infra/shmem.h"

PG_FUNCTION_INFO_V1(idem_outbox_enqueue);
PG_FUNCTION_INFO_V1(idem_outbox_enqueue_batch);
PG_FUNCTION_INFO_V1(idem_outbox_route);
PG_FUNCTION_INFO_V1(idem_outbox_fetch);
PG_FUNCTION_INFO_V1(idem_outbox_ack);
PG_FUNCTION_INFO_V1(idem_outbox_ack_fenced);
PG_FUNCTION_INFO_V1(idem_outbox_nack);
PG_FUNCTION_INFO_V1(idem_outbox_nack_fenced);
PG_FUNCTION_INFO_V1(idem_outbox_requeue);
PG_FUNCTION_INFO_V1(idem_outbox_discard);
PG_FUNCTION_INFO_V1(idem_outbox_on_shard);

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
 * for goes out at its next naptime.  On Citus, the routes are a reference
 * table that any node may change, while the version is this node's: what
 * is read is kept for a second at most.
 */
typedef struct RoutesCache
{
	bool		valid;
	uint64		version;
	TimestampTz stale_at;		/* on Citus: when to read again */
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
	routes_cache.stale_at = idem_table_distributed(IDEM_TABLE_OUTBOX) ?
		TimestampTzPlusMilliseconds(GetCurrentTimestamp(), 1000) : DT_NOEND;
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
	if (!routes_cache.valid || routes_cache.version != version ||
		(routes_cache.stale_at != DT_NOEND && GetCurrentTimestamp() >= routes_cache.stale_at))
		load_routes(version);

	key.topic = text_to_cstring(topic);
	found = bsearch(&key, routes_cache.known.routes, routes_cache.known.nroutes,
					sizeof(OutboxRoute), compare_routes);
	pfree(key.topic);
	return found != NULL ? found->routed : routes_cache.known.default_routed;
}

/* The per-key enqueue lock's hash of a (topic, key) pair. */
static uint64
outbox_key_hash(text *topic, text *key)
{
	uint64		hash;

	hash = hash_bytes_extended((const unsigned char *) VARDATA_ANY(topic),
							   VARSIZE_ANY_EXHDR(topic), 0);
	return hash_bytes_extended((const unsigned char *) VARDATA_ANY(key),
							   VARSIZE_ANY_EXHDR(key), hash);
}

/*
 * Serialise enqueuers of one (topic, key) until the end of the transaction.
 */
static void
lock_outbox_key(uint64 hash)
{
	LOCKTAG		tag;

	SET_LOCKTAG_ADVISORY(tag, MyDatabaseId, (uint32) (hash >> 32), (uint32) hash,
						 OUTBOX_KEY_LOCK_CLASS);
	(void) LockAcquire(&tag, ExclusiveLock, false, false);
}

static void
check_topic(text *topic)
{
	if (VARSIZE_ANY_EXHDR(topic) == 1 && *VARDATA_ANY(topic) == '*')
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("\"*\" is not a topic"),
				 errdetail("\"*\" names the default route in idem_outbox_route.")));
}

static void
check_headers(Jsonb *headers)
{
	if (headers != NULL && !JB_ROOT_IS_OBJECT(headers))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("headers must be a JSON object")));
}

/*
 * The enqueue's statement, STMT_ENQUEUE or STMT_ENQUEUE_BATCH, through a
 * kept plan (outbox_sql.c), on the outbox or, where Citus distributes it,
 * the topic's shard on this node.  The rows' ids are taken here, one by
 * one from the sequence (idem_outbox_next_id: on Citus, above the topic's
 * last id in the shard), after the keys' locks: see the top of this file.
 * A direct insert into the heap and its indexes was measured against this
 * and bought too little to keep (issue 29; doc/internals.md, "C where it
 * pays").
 */
static void
enqueue_sql_begin(OutboxSqlContext *context, text *topic, const char *function_name,
				  uint64 *hashes, int nhashes, int64 *floor)
{
	Oid			shard = idem_table_shard_for(IDEM_TABLE_OUTBOX, topic, RowExclusiveLock,
											 function_name);

	for (int i = 0; i < nhashes; i++)
		if (i == 0 || hashes[i] != hashes[i - 1])
			lock_outbox_key(hashes[i]);
	*floor = PG_INT64_MIN;
	if (OidIsValid(shard))
	{
		Relation	heap = table_open(shard, NoLock);

		*floor = idem_outbox_last_id(heap, topic);
		table_close(heap, NoLock);
	}
	if (!outbox_sql_begin_on(context, shard))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("the outbox's shard for this topic moved away from this node"),
				 errhint("Call %s again.", function_name)));
}

static int64
enqueue_sql(text *topic, text *key, Datum payload, Jsonb *headers)
{
	OutboxSqlContext context;
	uint64		hash = key != NULL ? outbox_key_hash(topic, key) : 0;
	int64		floor;
	int64		id;
	Datum		values[6];
	char		nulls[7] = "      ";

	enqueue_sql_begin(&context, topic, "idem_outbox_enqueue()", &hash, key != NULL ? 1 : 0,
					  &floor);
	id = idem_outbox_next_id(floor);
	values[0] = Int64GetDatum(id);
	values[1] = PointerGetDatum(topic);
	values[2] = PointerGetDatum(key);
	nulls[2] = key == NULL ? 'n' : ' ';
	values[3] = payload;
	values[4] = PointerGetDatum(headers);
	nulls[4] = headers == NULL ? 'n' : ' ';
	values[5] = TimestampTzGetDatum(GetCurrentTimestamp());
	(void) outbox_sql_run(STMT_ENQUEUE, values, nulls);
	outbox_sql_end(&context);
	return id;
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
	int64		id;

	check_topic(topic);
	if (PG_ARGISNULL(1))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("payload must not be null")));
	check_headers(headers);

	idem_require_writable("idem_outbox_enqueue()");
	id = enqueue_sql(topic, key, PG_GETARG_DATUM(1), headers);
	if (topic_is_routed(topic))
		idem_wake_worker_at_commit(id);

	PG_RETURN_INT64(id);
}

/*
 * The elements of an array argument, or an ERROR if it is not a list (more
 * than one dimension) or, with expected >= 0, not that long.
 */
static void
array_argument(FunctionCallInfo fcinfo, int argno, const char *name, Oid element_type,
			   int expected, Datum **elements, bool **nulls, int *count)
{
	ArrayType  *array = PG_GETARG_ARRAYTYPE_P(argno);
	int16		typlen;
	bool		typbyval;
	char		typalign;

	if (ARR_NDIM(array) > 1)
		ereport(ERROR,
				(errcode(ERRCODE_ARRAY_SUBSCRIPT_ERROR),
				 errmsg("%s must be a one-dimensional array", name)));
	get_typlenbyvalalign(element_type, &typlen, &typbyval, &typalign);
	deconstruct_array(array, element_type, typlen, typbyval, typalign,
					  elements, nulls, count);
	if (expected >= 0 && *count != expected)
		ereport(ERROR,
				(errcode(ERRCODE_ARRAY_SUBSCRIPT_ERROR),
				 errmsg_plural("%s has %d element, not %d",
							   "%s has %d elements, not %d",
							   *count, name, *count, expected),
				 errdetail("Each array gives one value per row: they must be equally long.")));
}

/* Sorts the per-key lock hashes of a batch, the order they are taken in. */
static int
compare_hashes(const void *a, const void *b)
{
	uint64		x = *(const uint64 *) a;
	uint64		y = *(const uint64 *) b;

	return x < y ? -1 : x > y ? 1 : 0;
}

/*
 * idem_outbox_enqueue_batch(topic, payloads, keys, headers) -> SETOF bigint
 *
 * One row per payload, the ids in array order.  Everything is checked
 * before anything is written.  The keys' locks are taken first, all of
 * them, in one order that does not depend on the arrays (by hash), so that
 * two batches naming the same keys in different orders never deadlock;
 * then the rows get their ids in array order, which is the order of the
 * rows of each key.
 */
Datum
idem_outbox_enqueue_batch(PG_FUNCTION_ARGS)
{
	text	   *topic = idem_arg_identifier(fcinfo, 0, "topic", 1);
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	Datum	   *payloads;
	bool	   *payload_nulls;
	int			count;
	Datum	   *keys = NULL;
	bool	   *key_nulls = NULL;
	Datum	   *headers = NULL;
	bool	   *header_nulls = NULL;
	int			ignored;
	uint64	   *hashes;
	int			nhashes = 0;
	OutboxSqlContext context;
	int64		floor;
	Datum	   *ids;
	Datum		values[6];
	char		nulls[7] = "      ";
	int			dims[1];
	int			lbs[1] = {1};

	check_topic(topic);
	if (PG_ARGISNULL(1))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("payloads must not be null")));
	array_argument(fcinfo, 1, "payloads", JSONBOID, -1, &payloads, &payload_nulls, &count);
	if (!PG_ARGISNULL(2))
		array_argument(fcinfo, 2, "keys", TEXTOID, count, &keys, &key_nulls, &ignored);
	if (!PG_ARGISNULL(3))
		array_argument(fcinfo, 3, "headers", JSONBOID, count, &headers, &header_nulls, &ignored);

	hashes = palloc(sizeof(uint64) * Max(count, 1));
	for (int i = 0; i < count; i++)
	{
		if (payload_nulls[i])
			ereport(ERROR,
					(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
					 errmsg("payloads must not contain nulls"),
					 errdetail("Element %d is null.", i + 1)));
		if (keys != NULL && !key_nulls[i])
		{
			text	   *key = DatumGetTextPP(keys[i]);
			int			len = VARSIZE_ANY_EXHDR(key);

			if (len < 1)
				ereport(ERROR,
						(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
						 errmsg("keys must not contain empty strings"),
						 errdetail("Element %d is empty.", i + 1)));
			if (len > IDEM_MAX_IDENTIFIER_BYTES)
				ereport(ERROR,
						(errcode(ERRCODE_STRING_DATA_RIGHT_TRUNCATION),
						 errmsg("key is too long"),
						 errdetail("Element %d is %d bytes long; the limit is %d bytes.",
								   i + 1, len, IDEM_MAX_IDENTIFIER_BYTES)));
			keys[i] = PointerGetDatum(key);
			hashes[nhashes++] = outbox_key_hash(topic, key);
		}
		if (headers != NULL && !header_nulls[i])
		{
			headers[i] = PointerGetDatum(DatumGetJsonbP(headers[i]));
			check_headers(DatumGetJsonbP(headers[i]));
		}
	}

	idem_require_writable("idem_outbox_enqueue_batch()");
	InitMaterializedSRF(fcinfo, MAT_SRF_USE_EXPECTED_DESC);
	if (count == 0)
		return (Datum) 0;
	ids = palloc(sizeof(Datum) * count);
	dims[0] = count;

	qsort(hashes, nhashes, sizeof(uint64), compare_hashes);
	enqueue_sql_begin(&context, topic, "idem_outbox_enqueue_batch()", hashes, nhashes,
					  &floor);
	/* the batch's ids grow from the first, which must be above the topic's last */
	for (int i = 0; i < count; i++)
	{
		bool		isnull = false;

		ids[i] = Int64GetDatum(idem_outbox_next_id(i == 0 ? floor : PG_INT64_MIN));
		tuplestore_putvalues(rsinfo->setResult, rsinfo->setDesc, &ids[i], &isnull);
	}
	values[0] = PointerGetDatum(construct_array(ids, count, INT8OID, 8, FLOAT8PASSBYVAL,
												TYPALIGN_DOUBLE));
	values[1] = PointerGetDatum(topic);
	if (keys != NULL)
		values[2] = PointerGetDatum(construct_md_array(keys, key_nulls, 1, dims, lbs,
													   TEXTOID, -1, false, TYPALIGN_INT));
	else
		nulls[2] = 'n';
	values[3] = PointerGetDatum(construct_array(payloads, count, JSONBOID, -1, false,
												TYPALIGN_INT));
	if (headers != NULL)
		values[4] = PointerGetDatum(construct_md_array(headers, header_nulls, 1, dims, lbs,
													   JSONBOID, -1, false, TYPALIGN_INT));
	else
		nulls[4] = 'n';
	values[5] = TimestampTzGetDatum(GetCurrentTimestamp());
	(void) outbox_sql_run(STMT_ENQUEUE_BATCH, values, nulls);
	outbox_sql_end(&context);
	if (topic_is_routed(topic))
		idem_wake_worker_at_commit(DatumGetInt64(ids[0]));

	return (Datum) 0;
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

/* The ids a fetch hands out, in the order it chose them. */
typedef struct HandOut
{
	Datum	   *ids;
	int			count;
	int			capacity;		/* of ids: what was found so far */
	int			limit;			/* the batch */
} HandOut;

/*
 * Add to the hand-out the rows of a head's key that follow it, as many as
 * fit under per_key and the batch, up to the first that is not ready.
 */
static void
add_followers(HandOut *handout, Datum *params, int64 head_id, Datum key, int per_key)
{
	int			room = Min(per_key - 1, handout->limit - handout->count);
	uint64		found;

	if (room <= 0)
		return;
	params[FETCH_LIMIT] = Int32GetDatum(room);
	params[FETCH_KEY] = key;
	params[FETCH_AFTER_ID] = Int64GetDatum(head_id);
	found = outbox_sql_run(STMT_FETCH_FOLLOWERS, params, NULL);
	if (handout->count + (int) found > handout->capacity)
	{
		handout->capacity = Max(handout->capacity * 2, handout->count + (int) found);
		handout->ids = repalloc(handout->ids, sizeof(Datum) * handout->capacity);
	}
	for (uint64 i = 0; i < found; i++)
	{
		bool		isnull;
		HeapTuple	row = SPI_tuptable->vals[i];

		if (!DatumGetBool(SPI_getbinval(row, SPI_tuptable->tupdesc, FOLLOWER_READY, &isnull)))
			break;
		handout->ids[handout->count++] =
			SPI_getbinval(row, SPI_tuptable->tupdesc, FOLLOWER_ID, &isnull);
	}
	SPI_freetuptable(SPI_tuptable);
}

/* The heads a fetch locked, in id order. */
typedef struct Heads
{
	int64	   *ids;
	Datum	   *keys;			/* when follows */
	bool	   *follows;		/* may rows of its key follow it? */
	uint64		count;
	uint64		capacity;
} Heads;

/*
 * Lock the ready heads among the candidates ($8) and add them to heads, up
 * to limit; returns how many there are now.
 */
static uint64
lock_heads(Datum *params, char *nulls, int64 *candidates, int ncandidates,
		   int per_key, uint64 limit, Heads *heads)
{
	Datum	   *ids = palloc(sizeof(Datum) * ncandidates);
	uint64		locked;

	for (int i = 0; i < ncandidates; i++)
		ids[i] = Int64GetDatum(candidates[i]);
	params[FETCH_IDS] = PointerGetDatum(construct_array(ids, ncandidates, INT8OID,
														sizeof(int64), FLOAT8PASSBYVAL,
														TYPALIGN_DOUBLE));
	nulls[FETCH_IDS] = ' ';
	locked = outbox_sql_run(STMT_FETCH_HEADS, params, nulls);
	nulls[FETCH_IDS] = 'n';
	if (heads->count + locked > heads->capacity)
	{
		heads->capacity = Max(heads->capacity * 2, heads->count + locked);
		heads->ids = repalloc(heads->ids, sizeof(int64) * heads->capacity);
		heads->keys = repalloc(heads->keys, sizeof(Datum) * heads->capacity);
		heads->follows = repalloc(heads->follows, sizeof(bool) * heads->capacity);
	}
	for (uint64 i = 0; i < locked && heads->count < limit; i++)
	{
		HeapTuple	row = SPI_tuptable->vals[i];
		TupleDesc	desc = SPI_tuptable->tupdesc;
		bool		key_null;
		bool		isnull;
		Datum		key = SPI_getbinval(row, desc, HEAD_KEY, &key_null);
		bool		exhausted = DatumGetBool(SPI_getbinval(row, desc, HEAD_EXHAUSTED, &isnull));
		uint64		n = heads->count++;

		heads->ids[n] = DatumGetInt64(SPI_getbinval(row, desc, HEAD_ID, &isnull));
		/* a head that dies now holds its key back: nothing follows it */
		heads->follows[n] = per_key > 1 && !key_null && !exhausted;
		heads->keys[n] = heads->follows[n] ? datumCopy(key, false, -1) : (Datum) 0;
	}
	SPI_freetuptable(SPI_tuptable);
	pfree(ids);
	return heads->count;
}

/*
 * The ready heads of the topic's keys, oldest first, up to batch of them,
 * locked (see STMT_FETCH_SCAN): the topic's unpublished rows are walked in
 * id order, and a row is a head if it is ready, and either has no key or is
 * the first row of its key met.  The candidates are locked a chunk at a
 * time, skipping those another relay is taking; the walk goes on until the
 * batch is full or the rows run out.
 */
static uint64
find_heads(Datum *params, char *nulls, int32 batch, int per_key, Heads *heads)
{
	Portal		portal;
	HTAB	   *seen = NULL;
	int64	   *candidates = NULL;
	int			ncandidates;

	heads->count = 0;
	heads->capacity = 16;
	heads->ids = palloc(sizeof(int64) * heads->capacity);
	heads->keys = palloc(sizeof(Datum) * heads->capacity);
	heads->follows = palloc(sizeof(bool) * heads->capacity);

	portal = outbox_sql_cursor_open(STMT_FETCH_SCAN, params, nulls);
	while (heads->count < (uint64) batch)
	{
		/* a chunk: as many rows as heads are still wanted, within reason */
		long		chunk = Max(Min((long) batch - (long) heads->count, 1000L), 16L);
		uint64		nrows;
		int64	   *ids;
		char	  **keys;
		bool	   *ready;
		uint64		pos = 0;

		SPI_cursor_fetch(portal, true, chunk);
		nrows = SPI_processed;
		if (nrows == 0)
			break;

		/* copied out: locking the candidates replaces SPI_tuptable */
		ids = palloc(sizeof(int64) * nrows);
		keys = palloc(sizeof(char *) * nrows);
		ready = palloc(sizeof(bool) * nrows);
		for (uint64 i = 0; i < nrows; i++)
		{
			HeapTuple	row = SPI_tuptable->vals[i];
			TupleDesc	desc = SPI_tuptable->tupdesc;
			bool		key_null;
			bool		isnull;
			Datum		key = SPI_getbinval(row, desc, SCAN_KEY, &key_null);

			ids[i] = DatumGetInt64(SPI_getbinval(row, desc, SCAN_ID, &isnull));
			ready[i] = DatumGetBool(SPI_getbinval(row, desc, SCAN_READY, &isnull));
			keys[i] = NULL;
			if (!key_null)
			{
				text	   *k = DatumGetTextPP(key);
				int			len = Min(VARSIZE_ANY_EXHDR(k), IDEM_MAX_IDENTIFIER_BYTES);

				keys[i] = palloc0(IDEM_MAX_IDENTIFIER_BYTES + 1);
				memcpy(keys[i], VARDATA_ANY(k), len);
			}
		}
		SPI_freetuptable(SPI_tuptable);
		if (candidates == NULL)
			candidates = palloc(sizeof(int64) * 1000);

		/*
		 * No more candidates at a time than heads are still wanted: a
		 * candidate is locked, and one locked but not handed out would stay
		 * locked, out of other relays' reach, until our transaction ends.
		 */
		while (pos < nrows && heads->count < (uint64) batch)
		{
			uint64		wanted = (uint64) batch - heads->count;

			ncandidates = 0;
			for (; pos < nrows && (uint64) ncandidates < wanted; pos++)
			{
				if (keys[pos] != NULL)
				{
					bool		found;

					if (seen == NULL)
					{
						HASHCTL		ctl;

						ctl.keysize = IDEM_MAX_IDENTIFIER_BYTES + 1;
						ctl.entrysize = IDEM_MAX_IDENTIFIER_BYTES + 1;
						ctl.hcxt = CurrentMemoryContext;
						seen = hash_create("idempotency outbox keys seen", 1024, &ctl,
										   HASH_ELEM | HASH_STRINGS | HASH_CONTEXT);
					}
					(void) hash_search(seen, keys[pos], HASH_ENTER, &found);
					if (found)
						continue;	/* an earlier row of its key is unpublished */
				}
				if (ready[pos])
					candidates[ncandidates++] = ids[pos];
			}
			if (ncandidates > 0)
				(void) lock_heads(params, nulls, candidates, ncandidates, per_key, batch, heads);
		}
		for (uint64 i = 0; i < nrows; i++)
			if (keys[i] != NULL)
				pfree(keys[i]);
		pfree(ids);
		pfree(keys);
		pfree(ready);
	}
	SPI_cursor_close(portal);
	if (seen != NULL)
		hash_destroy(seen);
	return heads->count;
}

/* A count argument: not NULL, and positive. */
static int32
positive_count(FunctionCallInfo fcinfo, int argno, const char *name)
{
	int32		value;

	if (PG_ARGISNULL(argno))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("%s must not be null", name)));
	value = PG_GETARG_INT32(argno);
	if (value <= 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("%s must be positive", name),
				 errdetail("The value given was %d.", value)));
	return value;
}

/*
 * On a distributed outbox, the pull API works on the shard of a topic, on
 * the node that holds it.  A fetch names its topic, and Citus delegates it
 * there (idem_distribute declares it a distributed function).  The calls
 * that name rows by id do not: they find the topics of their ids (Citus
 * reads every shard), and each topic's part is done on its shard's node by
 * idempotency._outbox_on_shard(topic, call, ...), a distributed function
 * that Citus delegates there, in the caller's transaction.  Both the look-up
 * and the calls run as the owner of the extension's tables (the caller has
 * been allowed to call the function, and need not reach the tables
 * themselves); their statements are literals, since Citus delegates a call
 * inside a function only with constant arguments.  Returns the sum of what
 * the topics' calls returned.
 */
static int32
on_the_topics_shards(const char *call, ArrayType *ids, ArrayType *attempts, text *error)
{
	OutboxSqlContext context;
	Datum		ids_arg = PointerGetDatum(ids);
	Oid			argtype = INT8ARRAYOID;
	Datum	   *all_ids;
	bool	   *id_nulls;
	Datum	   *all_attempts = NULL;
	bool	   *attempt_nulls = NULL;
	int			nids;
	int			nattempts;
	int32		total = 0;
	uint64		ntopics;
	SPITupleTable *topics;

	deconstruct_array(ids, INT8OID, sizeof(int64), FLOAT8PASSBYVAL, TYPALIGN_DOUBLE,
					  &all_ids, &id_nulls, &nids);
	if (attempts != NULL)
		deconstruct_array(attempts, INT4OID, sizeof(int32), true, TYPALIGN_INT,
						  &all_attempts, &attempt_nulls, &nattempts);

	outbox_sql_begin(&context);
	if (SPI_execute_with_args("SELECT topic, array_agg(id ORDER BY id)"
							  " FROM idempotency.outbox WHERE id = ANY ($1) GROUP BY topic",
							  1, &argtype, &ids_arg, NULL, true, 0) != SPI_OK_SELECT)
		elog(ERROR, "could not find the topics of the outbox rows");
	topics = SPI_tuptable;
	ntopics = SPI_processed;
	for (uint64 t = 0; t < ntopics; t++)
	{
		char	   *topic = SPI_getvalue(topics->vals[t], topics->tupdesc, 1);
		bool		isnull;
		ArrayType  *mine = DatumGetArrayTypeP(SPI_getbinval(topics->vals[t], topics->tupdesc, 2,
															&isnull));
		Datum	   *my_ids;
		int			nmine;
		StringInfoData sql;

		deconstruct_array(mine, INT8OID, sizeof(int64), FLOAT8PASSBYVAL, TYPALIGN_DOUBLE,
						  &my_ids, NULL, &nmine);
		initStringInfo(&sql);
		appendStringInfo(&sql, "SELECT * FROM idempotency._outbox_on_shard(%s, %s, '{",
						 quote_literal_cstr(topic), quote_literal_cstr(call));
		for (int i = 0; i < nmine; i++)
			appendStringInfo(&sql, "%s" INT64_FORMAT, i > 0 ? "," : "",
							 DatumGetInt64(my_ids[i]));
		appendStringInfoString(&sql, "}'::bigint[], ");
		if (all_attempts == NULL)
			appendStringInfoString(&sql, "NULL");
		else
		{
			/* the attempt given beside each of this topic's ids */
			appendStringInfoString(&sql, "'{");
			for (int i = 0; i < nmine; i++)
			{
				int32		attempt = -1;	/* matches no row */

				for (int j = 0; j < nids; j++)
					if (!id_nulls[j] && !attempt_nulls[j] &&
						DatumGetInt64(all_ids[j]) == DatumGetInt64(my_ids[i]))
					{
						/* the first, as the fenced statement reads it */
						attempt = DatumGetInt32(all_attempts[j]);
						break;
					}
				appendStringInfo(&sql, "%s%d", i > 0 ? "," : "", attempt);
			}
			appendStringInfoString(&sql, "}'");
		}
		appendStringInfo(&sql, "::integer[], %s)",
						 error != NULL ? quote_literal_cstr(text_to_cstring(error)) : "NULL::text");
		if (SPI_execute(sql.data, false, 0) != SPI_OK_SELECT || SPI_processed != 1)
			elog(ERROR, "could not run %s on the shard of topic \"%s\"", call, topic);
		total += DatumGetInt32(SPI_getbinval(SPI_tuptable->vals[0], SPI_tuptable->tupdesc, 1,
											 &isnull));
	}
	outbox_sql_end(&context);
	return total;
}

/*
 * The rows of the last statement, into the result: a shard's rows (of a
 * distributed outbox) by column name, since the table may keep dropped
 * columns that its shards, made by Citus from its definition, do not have.
 */
static void
put_outbox_rows(ReturnSetInfo *rsinfo, uint64 count)
{
	TupleConversionMap *map = convert_tuples_by_name(SPI_tuptable->tupdesc,
													 rsinfo->setDesc);

	for (uint64 i = 0; i < count; i++)
	{
		HeapTuple	row = SPI_tuptable->vals[i];

		tuplestore_puttuple(rsinfo->setResult,
							map != NULL ? execute_attr_map_tuple(row, map) : row);
	}
}

/*
 * idem_outbox_fetch(topic, batch, lease, per_key) -> SETOF idempotency.outbox
 *
 * Also bound to the 1.0 signature (topic, batch, lease): per_key is 1 then.
 *
 * The batch is filled with the ready heads of the topic's keys first,
 * oldest first; then, with per_key above 1, what room is left goes to the
 * rows that follow each head in its key, head by head.  Every row handed
 * out is leased to this caller with one more attempt (a hand-out, which no
 * earlier one of the row's shares: the fence); the rows come back in id
 * order.
 */
Datum
idem_outbox_fetch(PG_FUNCTION_ARGS)
{
	text	   *topic = idem_arg_identifier(fcinfo, 0, "topic", 1);
	int32		batch;
	int32		per_key = 1;
	Interval   *lease;
	ReturnSetInfo *rsinfo = (ReturnSetInfo *) fcinfo->resultinfo;
	Datum		params[FETCH_NPARAMS];
	char		nulls[FETCH_NPARAMS];
	OutboxSqlContext context;
	HandOut		handout;
	Heads		heads;
	uint64		nheads;
	uint64		fetched;
	Oid			shard;

	batch = positive_count(fcinfo, 1, "batch");
	if (PG_ARGISNULL(2))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("lease must not be null")));
	lease = idem_arg_duration(fcinfo, 2, "lease", 0);
	/* the 1.0 signature has no per_key */
	if (PG_NARGS() > 3)
		per_key = positive_count(fcinfo, 3, "per_key");

	idem_require_writable("idem_outbox_fetch()");
	shard = idem_table_shard_for(IDEM_TABLE_OUTBOX, topic, RowExclusiveLock,
								 "idem_outbox_fetch(topic, ...)");
	InitMaterializedSRF(fcinfo, MAT_SRF_USE_EXPECTED_DESC);

	memset(nulls, ' ', sizeof(nulls));
	params[FETCH_TOPIC] = PointerGetDatum(topic);
	params[FETCH_LIMIT] = Int32GetDatum(batch);
	params[FETCH_LEASE] = IntervalPGetDatum(lease);
	params[FETCH_NOW] = TimestampTzGetDatum(GetCurrentTimestamp());
	params[FETCH_MAX_ATTEMPTS] = Int32GetDatum(idem_outbox_max_attempts);
	params[FETCH_KEY] = (Datum) 0;
	params[FETCH_AFTER_ID] = Int64GetDatum(0);
	params[FETCH_IDS] = (Datum) 0;
	nulls[FETCH_KEY] = nulls[FETCH_IDS] = 'n';

	if (!outbox_sql_begin_on(&context, shard))
		elog(ERROR, "the outbox shard of topic \"%s\" is gone", text_to_cstring(topic));

	/* the heads, copied out before the followers' statements run */
	nheads = find_heads(params, nulls, batch, per_key, &heads);
	handout.capacity = Max((int) nheads, 1);
	handout.ids = palloc(sizeof(Datum) * handout.capacity);
	handout.count = 0;
	handout.limit = batch;
	for (uint64 i = 0; i < nheads; i++)
		handout.ids[handout.count++] = Int64GetDatum(heads.ids[i]);

	if (per_key > 1)
	{
		nulls[FETCH_KEY] = ' ';
		for (uint64 i = 0; i < nheads && handout.count < handout.limit; i++)
			if (heads.follows[i])
				add_followers(&handout, params, heads.ids[i], heads.keys[i], per_key);
	}

	if (handout.count > 0)
	{
		params[FETCH_IDS] = PointerGetDatum(construct_array(handout.ids, handout.count, INT8OID,
															sizeof(int64), FLOAT8PASSBYVAL,
															TYPALIGN_DOUBLE));
		nulls[FETCH_IDS] = ' ';
		fetched = outbox_sql_run(STMT_FETCH_LEASE, params, nulls);
		put_outbox_rows(rsinfo, fetched);
	}
	outbox_sql_end(&context);

	return (Datum) 0;
}

static int32 acknowledge_on(Oid shard, Datum ids, Datum attempts, bool fenced);

/*
 * The acknowledgements: the leased rows among ids (fenced: each still under
 * the hand-out that returned it with the attempt given beside it) are
 * published, each only together with or after every earlier row of its
 * key.  Returns how many were; an id not counted was not leased (any more),
 * or came ahead of an earlier row of its key.
 */
static int32
acknowledge(Datum ids, Datum attempts, bool fenced)
{
	idem_require_writable("idem_outbox_ack()");
	if (idem_table_distributed(IDEM_TABLE_OUTBOX))
		return on_the_topics_shards("ack", DatumGetArrayTypeP(ids),
									fenced ? DatumGetArrayTypeP(attempts) : NULL, NULL);
	return acknowledge_on(InvalidOid, ids, attempts, fenced);
}

/* Two text datums, byte for byte (the columns are COLLATE "C") */
static bool
same_text(Datum a, Datum b)
{
	text	   *x = DatumGetTextPP(a);
	text	   *y = DatumGetTextPP(b);

	return VARSIZE_ANY_EXHDR(x) == VARSIZE_ANY_EXHDR(y) &&
		memcmp(VARDATA_ANY(x), VARDATA_ANY(y), VARSIZE_ANY_EXHDR(x)) == 0;
}

/*
 * The answer of the order check made in SQL (STMT_ACK_CHECK, whose nrows
 * rows are in SPI_tuptable: id, topic, key, by topic, key and id), as
 * outbox_ack_unblocked gives it: the ids let through, and each key's chain.
 */
static ArrayType *
checked_in_sql(uint64 nrows, AckChains *chains)
{
	SPITupleTable *rows = SPI_tuptable;
	Datum	   *ids = palloc(sizeof(Datum) * Max(nrows, 1));
	uint64		first = 0;

	chains->nids = 0;
	chains->ids = palloc(sizeof(int64) * Max(nrows, 1));
	chains->starts = palloc(sizeof(bool) * Max(nrows, 1));
	for (uint64 i = 0; i < nrows; i++)
	{
		bool		isnull;

		ids[i] = SPI_getbinval(rows->vals[i], rows->tupdesc, ACK_CHECK_ID, &isnull);
	}
	while (first < nrows)
	{
		bool		topic_null;
		bool		key_null;
		Datum		topic = SPI_getbinval(rows->vals[first], rows->tupdesc, ACK_CHECK_TOPIC,
										  &topic_null);
		Datum		key = SPI_getbinval(rows->vals[first], rows->tupdesc, ACK_CHECK_KEY,
										&key_null);
		uint64		last = first;

		while (!key_null && last + 1 < nrows)
		{
			bool		next_null;
			Datum		next_topic = SPI_getbinval(rows->vals[last + 1], rows->tupdesc,
												   ACK_CHECK_TOPIC, &next_null);
			Datum		next_key = SPI_getbinval(rows->vals[last + 1], rows->tupdesc,
												 ACK_CHECK_KEY, &next_null);

			if (next_null || !same_text(next_topic, topic) || !same_text(next_key, key))
				break;
			last++;
		}
		for (uint64 i = first; last > first && i <= last; i++)
		{
			chains->starts[chains->nids] = i == first;
			chains->ids[chains->nids++] = DatumGetInt64(ids[i]);
		}
		first = last + 1;
	}
	return construct_array(ids, (int) nrows, INT8OID, sizeof(int64), FLOAT8PASSBYVAL,
						   TYPALIGN_DOUBLE);
}

/*
 * Is id among the first column of the n rows of table, which are in its
 * order (STMT_ACK_HOLD's ORDER BY o.id)?  A binary search: an ack of many
 * rows holds as many, and a scan per row made the ack quadratic (50,000 ids
 * of 50 keys took 4.7 s).
 */
static bool
among_rows(int64 id, SPITupleTable *table, uint64 n)
{
	uint64		lo = 0;
	uint64		hi = n;

	while (lo < hi)
	{
		uint64		mid = lo + (hi - lo) / 2;
		bool		isnull;
		int64		at = DatumGetInt64(SPI_getbinval(table->vals[mid], table->tupdesc, 1,
													 &isnull));

		if (at == id)
			return true;
		if (at < id)
			lo = mid + 1;
		else
			hi = mid;
	}
	return false;
}

static int
compare_int64(const void *a, const void *b)
{
	int64		x = *(const int64 *) a;
	int64		y = *(const int64 *) b;

	return x < y ? -1 : x > y ? 1 : 0;
}

/*
 * Hold the rows of the chains that come before another of their key (each
 * chain's rows but its last), locked until the transaction ends, and
 * return unblocked less each chain's rows from the first that is no longer
 * taken on; values and nulls are the ack's, values[3] set here.  Under READ
 * COMMITTED the lock reads a row changed since the snapshot as it is now:
 * whatever another relay did to a row meanwhile, the rows of its key after
 * it are then not acknowledged, where the write alone would have
 * acknowledged them behind it.  Under REPEATABLE READ, the lock of such a
 * row fails with 40001.
 */
static ArrayType *
hold_chains(ArrayType *unblocked, const AckChains *chains, bool fenced, Datum *values,
			const char *nulls, Snapshot snapshot)
{
	Datum	   *hold = palloc(sizeof(Datum) * chains->nids);
	int			nhold = 0;
	uint64		nheld;
	SPITupleTable *held;
	Datum	   *kept_ids;
	bool	   *kept_nulls;
	int			nkept;
	int64	   *dropped = palloc(sizeof(int64) * chains->nids);
	int			ndropped = 0;
	int			out = 0;

	for (int i = 0; i < chains->nids; i++)
		if (i + 1 < chains->nids && !chains->starts[i + 1])
			hold[nhold++] = Int64GetDatum(chains->ids[i]);
	values[3] = PointerGetDatum(construct_array(hold, nhold, INT8OID, sizeof(int64),
												FLOAT8PASSBYVAL, TYPALIGN_DOUBLE));
	nheld = outbox_sql_run_snapshot(fenced ? STMT_ACK_FENCED_HOLD : STMT_ACK_HOLD,
									values, nulls, snapshot);
	held = SPI_tuptable;

	/* in each chain, the first row not held (its last is never) and those after it */
	for (int first = 0, last; first < chains->nids; first = last + 1)
	{
		bool		gap = false;

		last = first;
		while (last + 1 < chains->nids && !chains->starts[last + 1])
			last++;
		for (int i = first; i <= last; i++)
		{
			if (!gap && i < last && !among_rows(chains->ids[i], held, nheld))
				gap = true;
			if (gap)
				dropped[ndropped++] = chains->ids[i];
		}
	}
	if (ndropped == 0)
		return unblocked;

	deconstruct_array(unblocked, INT8OID, sizeof(int64), FLOAT8PASSBYVAL, TYPALIGN_DOUBLE,
					  &kept_ids, &kept_nulls, &nkept);
	qsort(dropped, ndropped, sizeof(int64), compare_int64);
	for (int i = 0; i < nkept; i++)
	{
		int64		id = DatumGetInt64(kept_ids[i]);

		if (bsearch(&id, dropped, ndropped, sizeof(int64), compare_int64) == NULL)
			kept_ids[out++] = kept_ids[i];
	}
	return construct_array(kept_ids, out, INT8OID, sizeof(int64), FLOAT8PASSBYVAL,
						   TYPALIGN_DOUBLE);
}

/*
 * acknowledge, on the table or on one of its shards: the order check, read
 * from the indexes (outbox_ack.c) or, where it cannot be, in SQL, under one
 * snapshot; then the rows a later row of their key relies on are held
 * (hold_chains); then the write, of the rows let through that are still
 * taken.  A row another relay leased again (or a nack put back) while this
 * ran is thus left, with the rows of its key after it, and the count says
 * what was acknowledged: no 40001 under READ COMMITTED.
 */
static int32
acknowledge_on(Oid shard, Datum ids, Datum attempts, bool fenced)
{
	Datum		values[4];
	char		nulls[4] = {' ', ' ', ' ', ' '};
	OutboxSqlContext context;
	uint64		acknowledged;
	bool		keep = idem_outbox_retention_s != 0;
	Snapshot	snapshot;
	ArrayType  *unblocked;
	AckChains	chains;

	values[0] = ids;
	values[1] = TimestampTzGetDatum(GetCurrentTimestamp());
	values[2] = attempts;
	nulls[2] = fenced ? ' ' : 'n';
	values[3] = (Datum) 0;
	nulls[3] = 'n';

	if (!outbox_sql_begin_on(&context, shard))
		return 0;

	/*
	 * The check under one snapshot, the command counter advanced first, as
	 * SPI does before a statement, so that it sees what this transaction
	 * wrote so far.  On a shard of a distributed outbox, whose indexes have
	 * the shard's names, the check is the SQL one.
	 */
	CommandCounterIncrement();
	snapshot = RegisterSnapshot(GetTransactionSnapshot());
	unblocked = OidIsValid(shard) ? NULL :
		outbox_ack_unblocked(DatumGetArrayTypeP(ids),
							 fenced ? DatumGetArrayTypeP(attempts) : NULL,
							 fenced, snapshot, &chains);
	if (unblocked == NULL)
		unblocked = checked_in_sql(outbox_sql_run_snapshot(fenced ? STMT_ACK_FENCED_CHECK :
														   STMT_ACK_CHECK,
														   values, nulls, snapshot),
								   &chains);
	nulls[3] = ' ';
	if (chains.nids > 0)
		unblocked = hold_chains(unblocked, &chains, fenced, values, nulls, snapshot);
	values[3] = PointerGetDatum(unblocked);
	acknowledged = outbox_sql_run_snapshot(fenced ?
										   (keep ? STMT_ACK_CHECKED_FENCED_KEEP : STMT_ACK_CHECKED_FENCED_DELETE) :
										   (keep ? STMT_ACK_CHECKED_KEEP : STMT_ACK_CHECKED_DELETE),
										   values, nulls, snapshot);
	UnregisterSnapshot(snapshot);
	outbox_sql_end(&context);
	return (int32) acknowledged;
}

/*
 * idem_outbox_ack(ids) -> integer: leased rows among ids, now published.
 */
Datum
idem_outbox_ack(PG_FUNCTION_ARGS)
{
	if (PG_ARGISNULL(0))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("ids must not be null")));
	PG_RETURN_INT32(acknowledge(PG_GETARG_DATUM(0), (Datum) 0, false));
}

/*
 * idem_outbox_ack(ids, attempts) -> integer: the rows among ids still
 * leased under the hand-out that returned them (attempts[i], as fetched,
 * for ids[i]), now published.
 */
Datum
idem_outbox_ack_fenced(PG_FUNCTION_ARGS)
{
	ArrayType  *ids;
	ArrayType  *attempts;
	int			nids;
	int			nattempts;

	if (PG_ARGISNULL(0))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("ids must not be null")));
	if (PG_ARGISNULL(1))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("attempts must not be null"),
				 errhint("Pass the attempts column of the fetched rows, or call idem_outbox_ack(ids) to acknowledge unfenced.")));
	ids = PG_GETARG_ARRAYTYPE_P(0);
	attempts = PG_GETARG_ARRAYTYPE_P(1);
	if (ARR_NDIM(ids) > 1 || ARR_NDIM(attempts) > 1)
		ereport(ERROR,
				(errcode(ERRCODE_ARRAY_SUBSCRIPT_ERROR),
				 errmsg("ids and attempts must be one-dimensional arrays")));
	nids = ArrayGetNItems(ARR_NDIM(ids), ARR_DIMS(ids));
	nattempts = ArrayGetNItems(ARR_NDIM(attempts), ARR_DIMS(attempts));
	if (nids != nattempts)
		ereport(ERROR,
				(errcode(ERRCODE_ARRAY_SUBSCRIPT_ERROR),
				 errmsg("ids and attempts must be equally long"),
				 errdetail("Their lengths are %d and %d; attempts gives the attempt of each id, as fetched.",
						   nids, nattempts)));
	/* 1.1's rule, kept: the arrays pair by position, both from 1 */
	if (nids > 0 && (ARR_LBOUND(ids)[0] != 1 || ARR_LBOUND(attempts)[0] != 1))
		ereport(ERROR,
				(errcode(ERRCODE_ARRAY_SUBSCRIPT_ERROR),
				 errmsg("ids and attempts must be indexed from 1")));
	PG_RETURN_INT32(acknowledge(PointerGetDatum(ids), PointerGetDatum(attempts), true));
}

/*
 * The functions below act on one row by id ($1), and say whether they did:
 * on the table, or on its shard that holds the row (shard), or, where
 * Citus distributes the outbox and shard is not given, on the row's
 * shard's node (on_the_topics_shards, with call, the row's attempt, if
 * fenced, $7, and its error, if a nack, $2).
 */
static bool
change_one_row(Oid shard, OutboxStatement statement, Datum *values, const char *nulls,
			   const char *call)
{
	OutboxSqlContext context;
	uint64		changed;

	if (!OidIsValid(shard) && idem_table_distributed(IDEM_TABLE_OUTBOX))
	{
		bool		fenced = statement == STMT_NACK_FENCED;
		Datum		attempt = fenced ? values[6] : (Datum) 0;
		ArrayType  *ids = construct_array(&values[0], 1, INT8OID, sizeof(int64),
										  FLOAT8PASSBYVAL, TYPALIGN_DOUBLE);
		ArrayType  *attempts = fenced ?
			construct_array(&attempt, 1, INT4OID, sizeof(int32), true, TYPALIGN_INT) : NULL;
		bool		nack = statement == STMT_NACK || statement == STMT_NACK_FENCED;

		return on_the_topics_shards(call, ids, attempts,
									nack && nulls[1] != 'n' ? DatumGetTextPP(values[1]) : NULL) > 0;
	}
	if (!outbox_sql_begin_on(&context, shard))
		return false;
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
 * A nack of row id, on the table or its shard (see change_one_row): $1 id,
 * $2 error, $3 now, $4 max attempts, $5 and $6 the backoff, $7 the attempt
 * (fenced).
 */
static bool
nack_row(Oid shard, int64 id, text *error, bool fenced, int32 attempt)
{
	Datum		values[7];
	char		nulls[7] = {' ', ' ', ' ', ' ', ' ', ' ', 'n'};

	values[0] = Int64GetDatum(id);
	values[1] = PointerGetDatum(error);
	nulls[1] = error == NULL ? 'n' : ' ';
	values[2] = TimestampTzGetDatum(GetCurrentTimestamp());
	values[3] = Int32GetDatum(idem_outbox_max_attempts);
	values[4] = Int32GetDatum(idem_outbox_backoff_min_ms);
	values[5] = Int32GetDatum(Max(idem_outbox_backoff_min_ms, idem_outbox_backoff_max_ms));
	values[6] = Int32GetDatum(attempt);
	nulls[6] = fenced ? ' ' : 'n';
	return change_one_row(shard, fenced ? STMT_NACK_FENCED : STMT_NACK, values, nulls, "nack");
}

/* A requeue of row id: $1 id, $2 now. */
static bool
requeue_row(Oid shard, int64 id)
{
	Datum		values[2];

	values[0] = Int64GetDatum(id);
	values[1] = TimestampTzGetDatum(GetCurrentTimestamp());
	if (!change_one_row(shard, STMT_REQUEUE, values, NULL, "requeue"))
		return false;
	/* pending again, perhaps behind where the worker's rounds start (publish.c) */
	idem_wake_worker_at_commit(id);
	return true;
}

/* A discard of row id: $1 id. */
static bool
discard_row(Oid shard, int64 id)
{
	Datum		values[1];

	values[0] = Int64GetDatum(id);
	return change_one_row(shard, STMT_DISCARD, values, NULL, "discard");
}

static bool
negative_acknowledge(FunctionCallInfo fcinfo, bool fenced)
{
	int64		id = arg_row_id(fcinfo);

	if (fenced && PG_ARGISNULL(2))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("attempt must not be null"),
				 errhint("Pass the attempts column of the fetched row, or call idem_outbox_nack(id, error) to nack unfenced.")));
	idem_require_writable("idem_outbox_nack()");
	return nack_row(InvalidOid, id, PG_ARGISNULL(1) ? NULL : PG_GETARG_TEXT_PP(1),
					fenced, fenced ? PG_GETARG_INT32(2) : 0);
}

/*
 * idem_outbox_nack(id, error) -> boolean: false for a row not leased.
 */
Datum
idem_outbox_nack(PG_FUNCTION_ARGS)
{
	PG_RETURN_BOOL(negative_acknowledge(fcinfo, false));
}

/*
 * idem_outbox_nack(id, error, attempt) -> boolean: false for a row not
 * leased under the hand-out that returned it with that attempt.
 */
Datum
idem_outbox_nack_fenced(PG_FUNCTION_ARGS)
{
	PG_RETURN_BOOL(negative_acknowledge(fcinfo, true));
}

/*
 * idem_outbox_requeue(id) -> boolean: a dead row is pending again, with its
 * attempts reset; false for a row that is not dead.
 */
Datum
idem_outbox_requeue(PG_FUNCTION_ARGS)
{
	int64		id = arg_row_id(fcinfo);

	idem_require_writable("idem_outbox_requeue()");
	PG_RETURN_BOOL(requeue_row(InvalidOid, id));
}

/*
 * idem_outbox_discard(id) -> boolean: a dead row is deleted; false for a
 * row that is not dead.
 */
Datum
idem_outbox_discard(PG_FUNCTION_ARGS)
{
	int64		id = arg_row_id(fcinfo);

	idem_require_writable("idem_outbox_discard()");
	PG_RETURN_BOOL(discard_row(InvalidOid, id));
}

/*
 * idempotency._outbox_on_shard(topic, call, ids, attempts, error) ->
 * integer: one topic's part of an ack, nack, requeue or discard of a
 * distributed outbox (see on_the_topics_shards), on the shard of topic,
 * which Citus delegated the call to; how many rows it changed.  ids are
 * the topic's (one for the calls of one row), attempts are given beside
 * them when the call is fenced, error is a nack's.
 */
Datum
idem_outbox_on_shard(PG_FUNCTION_ARGS)
{
	text	   *topic = idem_arg_identifier(fcinfo, 0, "topic", 1);
	char	   *call;
	ArrayType  *ids;
	ArrayType  *attempts = PG_ARGISNULL(3) ? NULL : PG_GETARG_ARRAYTYPE_P(3);
	Datum	   *id_values;
	Datum	   *attempt_values = NULL;
	int			nids;
	int			nattempts = 0;
	Oid			shard;

	if (PG_ARGISNULL(1) || PG_ARGISNULL(2))
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("call and ids must not be null")));
	call = text_to_cstring(PG_GETARG_TEXT_PP(1));
	if (strcmp(call, "ack") != 0 && strcmp(call, "nack") != 0 &&
		strcmp(call, "requeue") != 0 && strcmp(call, "discard") != 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("\"%s\" is not a call of the outbox's rows", call),
				 errhint("The calls are ack, nack, requeue and discard.")));
	ids = PG_GETARG_ARRAYTYPE_P(2);
	deconstruct_array(ids, INT8OID, sizeof(int64), FLOAT8PASSBYVAL, TYPALIGN_DOUBLE,
					  &id_values, NULL, &nids);
	if (attempts != NULL)
		deconstruct_array(attempts, INT4OID, sizeof(int32), true, TYPALIGN_INT,
						  &attempt_values, NULL, &nattempts);
	if (attempts != NULL && nattempts != nids)
		ereport(ERROR,
				(errcode(ERRCODE_ARRAY_SUBSCRIPT_ERROR),
				 errmsg("ids and attempts must be equally long"),
				 errdetail("Their lengths are %d and %d.", nids, nattempts)));

	idem_require_writable("idem_outbox_ack()");
	shard = idem_table_shard_for(IDEM_TABLE_OUTBOX, topic, RowExclusiveLock,
								 "_outbox_on_shard(topic, ...)");
	if (strcmp(call, "ack") == 0)
		PG_RETURN_INT32(acknowledge_on(shard, PointerGetDatum(ids), PointerGetDatum(attempts),
									   attempts != NULL));
	if (nids != 1)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("a %s takes one id, not %d", call, nids)));
	if (strcmp(call, "nack") == 0)
		PG_RETURN_INT32(nack_row(shard, DatumGetInt64(id_values[0]),
								 PG_ARGISNULL(4) ? NULL : PG_GETARG_TEXT_PP(4),
								 attempts != NULL,
								 attempts != NULL ? DatumGetInt32(attempt_values[0]) : 0));
	if (strcmp(call, "requeue") == 0)
		PG_RETURN_INT32(requeue_row(shard, DatumGetInt64(id_values[0])));
	PG_RETURN_INT32(discard_row(shard, DatumGetInt64(id_values[0])));
}
