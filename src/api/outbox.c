/*-------------------------------------------------------------------------
 *
 * outbox.c
 *	  The transactional outbox: idem_outbox_enqueue, the routes, and the pull
 *	  API for external relays (fetch, ack, nack, requeue, discard).
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
 * The statements run through SPI with plans prepared once per backend, as
 * the owner of the extension's tables and with a pinned search_path, in the
 * manner of a SECURITY DEFINER function: EXECUTE on the function is what a
 * caller needs, as for the key functions, which reach their tables directly.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include <ctype.h>

#include "access/htup_details.h"
#include "access/xact.h"
#include "catalog/namespace.h"
#include "catalog/pg_class.h"
#include "commands/async.h"
#include "replication/message.h"
#include "catalog/pg_proc.h"
#include "catalog/pg_type.h"
#include "common/hashfn.h"
#include "executor/spi.h"
#include "funcapi.h"
#include "miscadmin.h"
#include "storage/lmgr.h"
#include "utils/acl.h"
#include "utils/array.h"
#include "utils/datum.h"
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

#include "api/outbox.h"
#include "compat.h"
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
 * The next try of a row that failed its attempts-th time, in milliseconds:
 * capped exponential backoff with "equal jitter" (half the exponential delay
 * plus a random part of the other half), never below the minimum nor above
 * the maximum.  $MIN and $MAX are the two settings.
 */
#define BACKOFF_MS_SQL(attempts, min, max) \
	"greatest(" min ", least(" max ", " min " * power(2, least(" attempts " - 1, 30)))" \
	" * (0.5 + random() / 2))"

/*
 * One topic's rows, oldest first, read from the outbox_ready index (topic,
 * id), which stops at the limit however many rows other topics have.  The
 * topic is pinned with two inequalities rather than "=", so that the
 * planner keeps ordering by (topic, id), which only that index provides;
 * with "=", it would drop the constant topic from the ordering and could
 * walk the primary key past every other topic's rows instead.
 */
#define ONE_TOPIC(param) "o.topic >= " param " AND o.topic <= " param

/*
 * The worker's candidates, in two steps.  First the ids: ready pending rows
 * of the routed topics, oldest first, skipping rows another transaction
 * holds (SKIP LOCKED), and leaving out rows held back by an earlier row of
 * their key that cannot go out now (leased, dead, or waiting for its
 * backoff) -- without that, a key stuck behind a dead row would fill every
 * batch and starve the other keys.  Then, for those few rows only, the route,
 * the message, and the id of the unpublished row of the key just before
 * each, which the C loop checks (see outbox_publish_batch).  Planned for
 * each execution (a custom plan), since how many rows a topic has varies
 * wildly.
 */
#define PUBLISH_CANDIDATES_SQL(topic_filter, order_by) \
	"WITH picked AS (" \
	"  SELECT o AS event, o.id, o.topic, o.key, o.payload, o.headers, o.created_at" \
	"  FROM idempotency.outbox o" \
	"  WHERE o.state = 'pending' AND o.available_at <= $1 AND " topic_filter \
	"    AND NOT EXISTS (SELECT FROM idempotency.outbox e" \
	"                    WHERE e.topic = o.topic AND e.key = o.key AND e.id < o.id" \
	"                      AND e.state <> 'published'" \
	"                      AND NOT (e.state = 'pending' AND e.available_at <= $1))" \
	"  ORDER BY " order_by " LIMIT $2" \
	"  FOR UPDATE OF o SKIP LOCKED)" \
	" SELECT p.event, p.id, r.target, r.destination, r.run_as," \
	"        json_build_object('id', p.id, 'topic', p.topic, 'key', p.key," \
	"                          'payload', p.payload, 'headers', p.headers," \
	"                          'created_at', p.created_at)::text AS message," \
	"        json_build_object('id', p.id, 'topic', p.topic, 'key', p.key," \
	"                          'truncated', true)::text AS reference," \
	"        (SELECT max(e.id) FROM idempotency.outbox e" \
	"         WHERE e.topic = p.topic AND e.key = p.key AND e.id < p.id" \
	"           AND e.state <> 'published') AS previous_id" \
	" FROM picked p" \
	" CROSS JOIN LATERAL (SELECT rt.target, rt.destination, rt.run_as" \
	"                     FROM idempotency.outbox_routes rt" \
	"                     WHERE rt.topic = p.topic OR rt.topic = '*'" \
	"                     ORDER BY rt.topic = '*' LIMIT 1) r" \
	" WHERE r.target <> 'none'" \
	" ORDER BY p.id"

typedef enum OutboxStatement
{
	STMT_FETCH,
	STMT_ACK_DELETE,
	STMT_ACK_KEEP,
	STMT_NACK,
	STMT_REQUEUE,
	STMT_DISCARD,
	STMT_ROUTE,
	STMT_PUBLISH_CANDIDATES_TOPIC,
	STMT_PUBLISH_CANDIDATES_EXCEPT,
	STMT_PUBLISH_CANDIDATE_ROW,
	STMT_ROUTES,
	STMT_MARK_PUBLISHED_DELETE,
	STMT_MARK_PUBLISHED_KEEP,
	STMT_PUBLISH_FAILED,
	STMT_PURGE_PUBLISHED,
	NUM_STATEMENTS
} OutboxStatement;

typedef struct StatementDef
{
	const char *sql;
	int			nargs;
	Oid			argtypes[6];
	bool		custom_plan;	/* plan for each execution's parameters */
} StatementDef;

/* Columns of STMT_PUBLISH_CANDIDATES. */
enum
{
	CANDIDATE_EVENT = 1,
	CANDIDATE_ID,
	CANDIDATE_TARGET,
	CANDIDATE_DESTINATION,
	CANDIDATE_RUN_AS,
	CANDIDATE_MESSAGE,
	CANDIDATE_REFERENCE,
	CANDIDATE_PREVIOUS_ID
};

static const StatementDef statements[NUM_STATEMENTS] = {
	/*
	 * Lease the ready heads of a topic: rows that no earlier unpublished row
	 * of the same key holds back, oldest first, skipping rows another relay
	 * is taking right now.  A leased row whose lease ran out is handed out
	 * again (one more attempt), or becomes dead if it has had them all.
	 * $1 topic, $2 batch, $3 lease, $4 now, $5 max attempts.
	 */
	[STMT_FETCH] = {
		"WITH candidate AS ("
		"  SELECT o.id, o.state = 'leased' AND o.attempts >= $5 AS exhausted"
		"  FROM idempotency.outbox o"
		"  WHERE " ONE_TOPIC("$1") " AND o.state IN ('pending', 'leased') AND o.available_at <= $4"
		"    AND NOT EXISTS (SELECT FROM idempotency.outbox earlier"
		"                    WHERE earlier.topic = o.topic AND earlier.key = o.key"
		"                      AND earlier.id < o.id AND earlier.state <> 'published')"
		"  ORDER BY o.topic, o.id LIMIT $2"
		"  FOR UPDATE OF o SKIP LOCKED"
		"), handed_out AS ("
		"  UPDATE idempotency.outbox o"
		"  SET state = CASE WHEN c.exhausted THEN 'dead' ELSE 'leased' END,"
		"      attempts = CASE WHEN c.exhausted THEN o.attempts ELSE o.attempts + 1 END,"
		"      last_error = CASE WHEN c.exhausted THEN 'lease ran out without acknowledgement'"
		"                        ELSE o.last_error END,"
		"      available_at = $4 + $3"
		"  FROM candidate c"
		"  WHERE o.id = c.id"
		"  RETURNING o.*"
		")"
		" SELECT * FROM handed_out WHERE state = 'leased' ORDER BY id",
		5, {TEXTOID, INT4OID, INTERVALOID, TIMESTAMPTZOID, INT4OID}, true
	},

	[STMT_ACK_DELETE] = {
		"DELETE FROM idempotency.outbox WHERE id = ANY ($1) AND state = 'leased'",
		1, {INT8ARRAYOID}
	},
	[STMT_ACK_KEEP] = {
		"UPDATE idempotency.outbox SET state = 'published', published_at = $2"
		" WHERE id = ANY ($1) AND state = 'leased'",
		2, {INT8ARRAYOID, TIMESTAMPTZOID}
	},

	/* $1 id, $2 error, $3 now, $4 max attempts, $5 backoff min, $6 backoff max */
	[STMT_NACK] = {
		"UPDATE idempotency.outbox"
		" SET state = CASE WHEN attempts >= $4 THEN 'dead' ELSE 'pending' END,"
		"     last_error = $2,"
		"     available_at = $3 + make_interval(secs => "
		BACKOFF_MS_SQL("attempts", "$5", "$6") " / 1000.0)"
		" WHERE id = $1 AND state = 'leased'",
		6, {INT8OID, TEXTOID, TIMESTAMPTZOID, INT4OID, INT4OID, INT4OID}
	},

	[STMT_REQUEUE] = {
		"UPDATE idempotency.outbox SET state = 'pending', attempts = 0, available_at = $2"
		" WHERE id = $1 AND state = 'dead'",
		2, {INT8OID, TIMESTAMPTZOID}
	},
	[STMT_DISCARD] = {
		"DELETE FROM idempotency.outbox WHERE id = $1 AND state = 'dead'",
		1, {INT8OID}
	},
	[STMT_ROUTE] = {
		"INSERT INTO idempotency.outbox_routes (topic, target, destination, run_as)"
		" VALUES ($1, $2, $3, $4)"
		" ON CONFLICT (topic) DO UPDATE"
		" SET target = excluded.target, destination = excluded.destination,"
		"     run_as = excluded.run_as",
		4, {TEXTOID, TEXTOID, TEXTOID, REGROLEOID}
	},

	/*
	 * The background worker's next batch (see PUBLISH_CANDIDATES_SQL): $1
	 * now, $2 batch size, and $3: one routed topic, when there is no default
	 * route (one query per topic, so that each reads its part of the
	 * outbox_ready index in id order and stops at the limit, however long the
	 * backlog), or the topics routed to none, when there is one.
	 */
	[STMT_PUBLISH_CANDIDATES_TOPIC] = {
		PUBLISH_CANDIDATES_SQL(ONE_TOPIC("$3"), "o.topic, o.id"),
		3, {TIMESTAMPTZOID, INT4OID, TEXTOID}, true
	},
	[STMT_PUBLISH_CANDIDATES_EXCEPT] = {
		PUBLISH_CANDIDATES_SQL("o.topic <> ALL ($3)", "o.id"),
		3, {TIMESTAMPTZOID, INT4OID, TEXTARRAYOID}, true
	},
	/* one row, by id ($3), if it is still a candidate (see outbox_publish_row) */
	[STMT_PUBLISH_CANDIDATE_ROW] = {
		PUBLISH_CANDIDATES_SQL("o.id = $3", "o.id"),
		3, {TIMESTAMPTZOID, INT4OID, INT8OID}
	},
	[STMT_ROUTES] = {
		"SELECT topic, target <> 'none' AS routed FROM idempotency.outbox_routes",
		0, {}
	},
	[STMT_MARK_PUBLISHED_DELETE] = {
		"DELETE FROM idempotency.outbox WHERE id = ANY ($1)",
		1, {INT8ARRAYOID}
	},
	[STMT_MARK_PUBLISHED_KEEP] = {
		"UPDATE idempotency.outbox"
		" SET state = 'published', published_at = $2, attempts = attempts + 1"
		" WHERE id = ANY ($1)",
		2, {INT8ARRAYOID, TIMESTAMPTZOID}
	},
	/*
	 * $1 id, $2 error, $3 now, $4 max attempts, $5 backoff min, $6 backoff
	 * max.  Only a pending row: a batch's candidates are, and locked, but a
	 * row whose attempt is recorded after its transaction failed
	 * (outbox_record_failure) may have been requeued, discarded or leased by
	 * then.
	 */
	[STMT_PUBLISH_FAILED] = {
		"UPDATE idempotency.outbox"
		" SET attempts = attempts + 1,"
		"     state = CASE WHEN attempts + 1 >= $4 THEN 'dead' ELSE 'pending' END,"
		"     last_error = $2,"
		"     available_at = $3 + make_interval(secs => "
		BACKOFF_MS_SQL("(attempts + 1)", "$5", "$6") " / 1000.0)"
		" WHERE id = $1 AND state = 'pending'",
		6, {INT8OID, TEXTOID, TIMESTAMPTZOID, INT4OID, INT4OID, INT4OID}
	},
	/* $1 published before, $2 batch size */
	[STMT_PURGE_PUBLISHED] = {
		"DELETE FROM idempotency.outbox WHERE id IN ("
		"  SELECT id FROM idempotency.outbox"
		"  WHERE state = 'published' AND published_at <= $1"
		"  ORDER BY published_at LIMIT $2 FOR UPDATE SKIP LOCKED)",
		2, {TIMESTAMPTZOID, INT4OID}
	},
};

/* Plans prepared on first use and kept for the backend's life. */
static SPIPlanPtr plans[NUM_STATEMENTS];

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
typedef struct KnownRoute
{
	char	   *topic;
	bool		routed;			/* somewhere other than none */
} KnownRoute;

typedef struct RoutesCache
{
	bool		valid;
	uint64		version;
	bool		default_routed; /* "*" is routed somewhere other than none */
	int			nroutes;
	KnownRoute *routes;			/* by topic, in byte order (the column is "C") */
} RoutesCache;

static RoutesCache routes_cache;
static MemoryContext routes_context = NULL;

/*
 * Enter the context the outbox's statements run in: as the owner of the
 * extension's tables, with search_path pinned to pg_catalog, connected to
 * SPI.  An error on the way out of here is cleaned up by the transaction's
 * abort, which restores the user and the settings.
 */
void
outbox_sql_begin(OutboxSqlContext *context)
{
	Oid			owner = idem_outbox_owner();

	GetUserIdAndSecContext(&context->saved_userid, &context->saved_sec_context);
	SetUserIdAndSecContext(owner,
						   context->saved_sec_context | SECURITY_LOCAL_USERID_CHANGE);
	context->guc_nest_level = NewGUCNestLevel();
	(void) set_config_option("search_path", "pg_catalog, pg_temp",
							 PGC_USERSET, PGC_S_SESSION, GUC_ACTION_SAVE,
							 true, 0, false);
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
}

void
outbox_sql_end(OutboxSqlContext *context)
{
	SPI_finish();
	AtEOXact_GUC(true, context->guc_nest_level);
	SetUserIdAndSecContext(context->saved_userid, context->saved_sec_context);
}

/* The plan of one of the statements above, prepared on first use. */
static SPIPlanPtr
outbox_plan(OutboxStatement statement)
{
	if (plans[statement] == NULL)
	{
		const StatementDef *def = &statements[statement];
		SPIPlanPtr	plan = SPI_prepare_cursor(def->sql, def->nargs, (Oid *) def->argtypes,
											  def->custom_plan ? CURSOR_OPT_CUSTOM_PLAN : 0);

		if (plan == NULL)
			elog(ERROR, "could not prepare outbox statement %d: %s",
				 (int) statement, SPI_result_code_string(SPI_result));
		if (SPI_keepplan(plan) != 0)
			elog(ERROR, "could not keep outbox statement %d", (int) statement);
		plans[statement] = plan;
	}
	return plans[statement];
}

/* Run one of the statements above; returns SPI_processed. */
static uint64
outbox_sql_run(OutboxStatement statement, Datum *values, const char *nulls)
{
	int			ret = SPI_execute_plan(outbox_plan(statement), values, nulls, false, 0);

	if (ret < 0)
		elog(ERROR, "outbox statement %d failed: %s",
			 (int) statement, SPI_result_code_string(ret));
	return SPI_processed;
}

static int
compare_routes(const void *a, const void *b)
{
	return strcmp(((const KnownRoute *) a)->topic, ((const KnownRoute *) b)->topic);
}

/* Read the routes into routes_cache (see there). */
static void
load_routes(uint64 version)
{
	OutboxSqlContext context;
	MemoryContext old;
	uint64		nroutes;

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
	nroutes = SPI_processed;
	old = MemoryContextSwitchTo(routes_context);
	routes_cache.default_routed = false;
	routes_cache.nroutes = 0;
	routes_cache.routes = palloc(sizeof(KnownRoute) * Max(nroutes, 1));
	for (uint64 i = 0; i < nroutes; i++)
	{
		bool		isnull;
		char	   *topic = TextDatumGetCString(SPI_getbinval(SPI_tuptable->vals[i],
															  SPI_tuptable->tupdesc, 1, &isnull));
		bool		routed = DatumGetBool(SPI_getbinval(SPI_tuptable->vals[i],
														SPI_tuptable->tupdesc, 2, &isnull));

		if (strcmp(topic, "*") == 0)
			routes_cache.default_routed = routed;
		else
		{
			routes_cache.routes[routes_cache.nroutes].topic = topic;
			routes_cache.routes[routes_cache.nroutes++].routed = routed;
		}
	}
	qsort(routes_cache.routes, routes_cache.nroutes, sizeof(KnownRoute), compare_routes);
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
	KnownRoute	key;
	KnownRoute *found;

	if (!idem_routes_version(&version))
		return false;
	if (!routes_cache.valid || routes_cache.version != version)
		load_routes(version);

	key.topic = text_to_cstring(topic);
	found = bsearch(&key, routes_cache.routes, routes_cache.nroutes, sizeof(KnownRoute),
					compare_routes);
	pfree(key.topic);
	return found != NULL ? found->routed : routes_cache.default_routed;
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

/*
 * ---------------------------------------------------------------------
 * Publishing, for the background worker and idem_run_maintenance()
 * ---------------------------------------------------------------------
 */

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
	Oid			saved_userid;
	int			saved_sec_context;
	int			guc_nest_level;
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

	GetUserIdAndSecContext(&saved_userid, &saved_sec_context);
	SetUserIdAndSecContext(run_as, saved_sec_context |
						   SECURITY_LOCAL_USERID_CHANGE | SECURITY_RESTRICTED_OPERATION);
	guc_nest_level = NewGUCNestLevel();
	(void) set_config_option("search_path", "pg_catalog, pg_temp",
							 PGC_USERSET, PGC_S_SESSION, GUC_ACTION_SAVE,
							 true, 0, false);
	fmgr_info(funcoid, &flinfo);
	InitFunctionCallInfoData(*fcinfo, &flinfo, 1, InvalidOid, NULL, NULL);
	fcinfo->args[0].value = event;
	fcinfo->args[0].isnull = false;
	outbox_identity(&relid_before, &storage_before);
	(void) FunctionCallInvoke(fcinfo);	/* its result, NULL or not, is ignored */
	AtEOXact_GUC(false, guc_nest_level);
	SetUserIdAndSecContext(saved_userid, saved_sec_context);

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

static void
publish_one(const Candidate *candidate)
{
	/* idem_outbox_route never stores one, but the table's CHECK allows it */
	if (candidate->destination == NULL)
		ereport(ERROR,
				(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
				 errmsg("the %s route of the row's topic has no destination", candidate->target),
				 errhint("Set the route again with idem_outbox_route.")));
	if (strcmp(candidate->target, "notify") == 0)
		Async_Notify(candidate->destination,
					 strlen(candidate->message) <= NOTIFY_PAYLOAD_LIMIT ?
					 candidate->message : candidate->reference);
	else if (strcmp(candidate->target, "logical") == 0)
		(void) compat_log_logical_message(candidate->destination, candidate->message,
										  strlen(candidate->message), true);
	else if (strcmp(candidate->target, "function") == 0)
		call_route_function(candidate->destination, candidate->run_as, candidate->event);
	else
		elog(ERROR, "unknown outbox route target \"%s\"", candidate->target);
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
bool
outbox_error_counts_against_row(const ErrorData *error)
{
	if (error->sqlerrcode == ERRCODE_OUT_OF_MEMORY)
		return false;
	if (error->sqlerrcode == ERRCODE_QUERY_CANCELED ||
		error->sqlerrcode == ERRCODE_ADMIN_SHUTDOWN)
		return error->funcname == NULL || strcmp(error->funcname, "ProcessInterrupts") != 0;
	return true;
}

/*
 * Try to publish one row inside a subtransaction, so that a failure (an
 * ERROR in the user's function, most likely) undoes only this row's attempt.
 * Returns NULL on success, or the error message.
 */
static char *
try_publish(const Candidate *candidate, MemoryContext keep)
{
	MemoryContext caller = CurrentMemoryContext;
	ResourceOwner owner = CurrentResourceOwner;
	char	   *volatile error = NULL;

	BeginInternalSubTransaction(NULL);
	MemoryContextSwitchTo(caller);
	PG_TRY();
	{
		publish_one(candidate);
		ReleaseCurrentSubTransaction();
	}
	PG_CATCH();
	{
		ErrorData  *edata;

		MemoryContextSwitchTo(keep);
		edata = CopyErrorData();
		FlushErrorState();
		RollbackAndReleaseCurrentSubTransaction();

		/* a cancel or a shutdown is not the row's fault: let it through */
		if (!outbox_error_counts_against_row(edata))
			ReThrowError(edata);
		error = edata->message != NULL ? edata->message : pstrdup("unknown error");
	}
	PG_END_TRY();
	MemoryContextSwitchTo(caller);
	CurrentResourceOwner = owner;
	return error;
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
} CandidateList;

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

		candidate->event = datumCopy(SPI_getbinval(tuple, desc, CANDIDATE_EVENT, &isnull),
									 false, -1);
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
			error = try_publish(candidate, list->context);
		else
		{
			publish_one(candidate);
			error = NULL;
		}
		if (error == NULL)
		{
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

	if (npublished > 0)
	{
		Datum	   *ids = palloc(sizeof(Datum) * npublished);
		Datum		values[2];

		for (uint64 i = 0; i < npublished; i++)
			ids[i] = Int64GetDatum(published[i]);
		values[0] = PointerGetDatum(construct_array(ids, (int) npublished, INT8OID,
													sizeof(int64), FLOAT8PASSBYVAL,
													TYPALIGN_DOUBLE));
		values[1] = TimestampTzGetDatum(now);
		outbox_sql_run(idem_outbox_retention_s == 0 ?
					   STMT_MARK_PUBLISHED_DELETE : STMT_MARK_PUBLISHED_KEEP,
					   values, NULL);
	}
	*published_count = npublished;
}

/*
 * Publish up to limit ready rows, in the current transaction: each row's
 * publication (NOTIFY, logical message, or the function's work) commits
 * together with the row's removal or its "published" mark, so that it
 * happens exactly once even if the server stops in between.  Carefully,
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
uint64
outbox_publish_batch(TimestampTz now, int limit, bool careful,
					 uint64 *published_count, uint64 *failed_count,
					 OutboxRowIds *tried)
{
	OutboxSqlContext context;
	Datum		values[3];
	CandidateList list = {NULL, 0, 0, CurrentMemoryContext};

	*published_count = *failed_count = 0;
	if (tried != NULL)
		tried->count = 0;
	outbox_sql_begin(&context);

	/*
	 * Which topics to look at: with no default route (or a default of none),
	 * only the routed ones; otherwise all but those routed to none.  Without
	 * any routed topic there is nothing to do, and nothing to scan.
	 */
	{
		uint64		nroutes = outbox_sql_run(STMT_ROUTES, NULL, NULL);
		bool		default_routed = false;
		Datum	   *routed = palloc(sizeof(Datum) * Max(nroutes, 1));
		Datum	   *unrouted = palloc(sizeof(Datum) * Max(nroutes, 1));
		int			nrouted = 0;
		int			nunrouted = 0;

		for (uint64 i = 0; i < nroutes; i++)
		{
			bool		isnull;
			Datum		topic = SPI_getbinval(SPI_tuptable->vals[i], SPI_tuptable->tupdesc, 1, &isnull);
			bool		is_routed = DatumGetBool(SPI_getbinval(SPI_tuptable->vals[i],
															   SPI_tuptable->tupdesc, 2, &isnull));
			char	   *name = TextDatumGetCString(topic);

			if (strcmp(name, "*") == 0)
				default_routed = is_routed;
			else if (is_routed)
				routed[nrouted++] = CStringGetTextDatum(name);
			else
				unrouted[nunrouted++] = CStringGetTextDatum(name);
		}
		if (!default_routed && nrouted == 0)
		{
			outbox_sql_end(&context);
			return 0;
		}
		values[0] = TimestampTzGetDatum(now);
		values[1] = Int32GetDatum(limit);
		if (default_routed)
		{
			values[2] = PointerGetDatum(construct_array(unrouted, nunrouted, TEXTOID,
														-1, false, TYPALIGN_INT));
			copy_candidates(outbox_sql_run(STMT_PUBLISH_CANDIDATES_EXCEPT, values, NULL),
							&list);
		}
		else
		{
			for (int t = 0; t < nrouted; t++)
			{
				values[2] = routed[t];
				copy_candidates(outbox_sql_run(STMT_PUBLISH_CANDIDATES_TOPIC, values, NULL),
								&list);
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
bool
outbox_publish_row(TimestampTz now, int64 id, volatile bool *started,
				   uint64 *published_count, uint64 *failed_count)
{
	OutboxSqlContext context;
	Datum		values[3];
	CandidateList list = {NULL, 0, 0, CurrentMemoryContext};

	*published_count = *failed_count = 0;
	*started = false;
	outbox_sql_begin(&context);
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
bool
outbox_record_failure(TimestampTz now, int64 id, const char *error)
{
	OutboxSqlContext context;
	bool		recorded;

	ereport(LOG,
			(errmsg("idempotency: outbox row %lld could not be published: its transaction failed: %s",
					(long long) id, error)));
	outbox_sql_begin(&context);
	record_failed_attempt(id, error, now);
	recorded = SPI_processed > 0;
	outbox_sql_end(&context);
	return recorded;
}

/*
 * Delete up to limit published rows older than idempotency.outbox_retention.
 */
uint64
outbox_purge_published(TimestampTz now, int limit)
{
	OutboxSqlContext context;
	Datum		values[2];
	uint64		deleted;

	values[0] = TimestampTzGetDatum(TimestampTzPlusMilliseconds(now,
																-(int64) idem_outbox_retention_s * 1000));
	values[1] = Int32GetDatum(limit);
	outbox_sql_begin(&context);
	deleted = outbox_sql_run(STMT_PURGE_PUBLISHED, values, NULL);
	outbox_sql_end(&context);
	return deleted;
}
