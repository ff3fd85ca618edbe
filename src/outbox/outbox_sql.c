/*-------------------------------------------------------------------------
 *
 * outbox_sql.c
 *	  The outbox's SQL: the statements that read and write
 *	  idempotency.outbox and outbox_routes, prepared once per backend and
 *	  run through SPI, as the owner of the extension's tables and with a
 *	  pinned search_path, in the manner of a SECURITY DEFINER function:
 *	  EXECUTE on a function is what a caller needs, as for the key
 *	  functions, which reach their tables directly (tables.c).
 *
 * The outbox goes through SQL where the keys do not: its reads are
 * set-oriented (the heads of each key, SKIP LOCKED), which the executor
 * does well, and no caller needs the direct path's "never wait".
 *
 * Owns: the statements' text, their plans, and the reading of the routes.
 * May call: tables/tables.h (the owner), infra/run_as.h.  Called by the
 * SQL API (outbox/outbox.c), publishing (outbox/publish.c) and the purge
 * (worker/purge.c).
 *
 * One library serves databases at 1.1 and at 1.2 of the SQL objects, as
 * the key functions serve 1.0 and 1.1 (keys/keys.c): 1.2 added the
 * failures column, and the statements that decide on failed tries read it
 * there, where 1.1's read attempts (statements_1_1, below).  Which schema a
 * database has is read from the outbox's columns each time a context is
 * begun (a cached relcache entry: nothing to pay), and each schema's
 * statements have plans of their own, so that a backend that lived through
 * ALTER EXTENSION UPDATE runs 1.2's from its next call on.
 *
 * Where Citus distributes the outbox, its rows are in shards, plain tables
 * on the node that holds them: the statements run on one shard at a time,
 * the same text with the shard's name for idempotency.outbox and this
 * node's placement of the routes (a reference table) for outbox_routes,
 * planned once per shard (outbox_sql_begin_on).  Citus leaves a shard's
 * rows to whoever writes them (it refuses only DDL, TRUNCATE and LOCK of a
 * shard), and plans a statement that names no Citus table as PostgreSQL
 * does.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "catalog/namespace.h"
#include "catalog/pg_type.h"
#include "executor/spi.h"
#include "lib/stringinfo.h"
#include "miscadmin.h"
#include "storage/lmgr.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/hsearch.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"

#include "outbox/outbox_sql.h"
#include "citus/shards.h"
#include "tables/tables.h"
#include "infra/guc.h"
#include "infra/plan_settings.h"
#include "infra/run_as.h"

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
 * Where a round of the worker starts a walk (STMT_PUBLISH_OLDEST and the
 * like): the rows still to go, pending or leased; a dead one waits for a
 * requeue, which tells the worker.  Past the newest row: where a walk
 * starts that has none of them before it.
 */
#define STILL_TO_GO "o.state IN ('pending', 'leased') AND o.published_at IS NULL"
#define PAST_THE_NEWEST "(SELECT o.id + 1 FROM idempotency.outbox o ORDER BY o.id DESC LIMIT 1)"

/* The most topics STMT_PUBLISH_OLDEST_EXCEPT looks through (see there). */
#define OLDEST_TOPICS_MAX "1000"

/*
 * The worker's candidates, in two steps.  First the ids: ready pending rows
 * of the routed topics, oldest first, skipping rows another transaction
 * holds (SKIP LOCKED), and leaving out rows held back by an earlier row of
 * their key that cannot go out now (leased, dead, or waiting for its
 * backoff) -- without that, a key stuck behind a dead row would fill every
 * batch and starve the other keys.  Then, for those few rows only, the route,
 * the message, and the id of the unpublished row of the key just before
 * each, which the C loop checks (see outbox_publish_batch).
 *
 * The ids must come from a walk of an index in the order wanted, which
 * stops at the limit: then a batch costs its rows, however long the
 * backlog.  Left to its estimates, the planner chose otherwise whenever the
 * statistics were stale, as they are after a burst (ANALYZE saw the outbox
 * nearly empty): a bitmap scan of every pending row, the NOT EXISTS run for
 * each, and a sort to keep the first hundred, so that a batch took longer
 * the longer the backlog grew, and publishing fell behind for good; or, the
 * walk in order, with the NOT EXISTS made an anti-join whose inner side,
 * the held-back rows, was found by reading the whole outbox for each batch.  So the NOT EXISTS is kept a probe of outbox_key_order per
 * candidate (OFFSET 0 keeps the planner from turning it into a join), and
 * the statement for one topic is planned with the other ways out of the
 * planner's reach (walk_in_order_settings, infra/plan_settings.c), as
 * one generic plan (see STMT_PUBLISH_CANDIDATES_TOPIC).
 */
#define PUBLISH_CANDIDATES_SQL(topic_filter, order_by) \
	"WITH picked AS (" \
	"  SELECT o AS event, o.id, o.topic, o.key, o.payload, o.headers, o.created_at" \
	"  FROM idempotency.outbox o" \
	"  WHERE o.state = 'pending' AND o.published_at IS NULL AND o.available_at <= $1" \
	"    AND " topic_filter \
	"    AND NOT EXISTS (SELECT FROM idempotency.outbox e" \
	"                    WHERE e.topic = o.topic AND e.key = o.key AND e.id < o.id" \
	"                      AND e.state <> 'published' AND e.published_at IS NULL" \
	"                      AND NOT (e.state = 'pending' AND e.available_at <= $1)" \
	"                    OFFSET 0)" \
	"  ORDER BY " order_by " LIMIT $2" \
	"  FOR UPDATE OF o SKIP LOCKED)" \
	" SELECT p.event, p.id, r.target, r.destination, r.run_as," \
	"        json_build_object('id', p.id, 'topic', p.topic, 'key', p.key," \
	"                          'payload', p.payload, 'headers', p.headers," \
	"                          'created_at', p.created_at)::text AS message," \
	"        json_build_object('id', p.id, 'topic', p.topic, 'key', p.key," \
	"                          'truncated', true, 'read'," \
	"                          'SELECT payload, headers, created_at" \
	" FROM idempotency.outbox WHERE id = ' || p.id)::text AS reference," \
	"        (SELECT max(e.id) FROM idempotency.outbox e" \
	"         WHERE e.topic = p.topic AND e.key = p.key AND e.id < p.id" \
	"           AND e.state <> 'published' AND e.published_at IS NULL) AS previous_id" \
	" FROM picked p" \
	" CROSS JOIN LATERAL (SELECT rt.target, rt.destination, rt.run_as" \
	"                     FROM idempotency.outbox_routes rt" \
	"                     WHERE rt.topic = p.topic OR rt.topic = '*'" \
	"                     ORDER BY rt.topic = '*' LIMIT 1) r" \
	" WHERE r.target <> 'none'" \
	" ORDER BY p.id"

/*
 * The parameters every statement of a fetch gets: $1 topic, $2 how many
 * rows, $3 lease, $4 now, $5 max attempts, $6 key, $7 the head's id, $8
 * the ids to lease.
 */
#define FETCH_NARGS 8
#define FETCH_ARGTYPES \
	{TEXTOID, INT4OID, INTERVALOID, TIMESTAMPTZOID, INT4OID, TEXTOID, INT8OID, INT8ARRAYOID}

/*
 * The rows of $1 an acknowledgement takes: leased (and, fenced, still under
 * the hand-out whose attempts $3 gives for each), with no earlier
 * unpublished row of their key that is not taken too.  An earlier row that
 * is taken but is itself held back holds back the later ones through the
 * same test, since whatever holds it back is earlier than them as well.
 *
 * The test is made once per key, not once per row: for each key among the
 * ids, its first blocking row (ACK_BLOCKING), the oldest unpublished row not
 * taken that is older than the newest of the ids of that key; a taken row
 * is acknowledged if it comes before its key's first blocking row, or its
 * key has none.
 * That is the same answer (a blocking row older than a taken row is older
 * than the newest of the key's ids), read in one walk of the key's part of
 * outbox_key_order rather than one from the key's start per row, which for
 * a hand-out of many rows of one key was quadratic.  The walk starts at the
 * topic's oldest unpublished row (oldest, from outbox_ready, once per topic):
 * nothing older can block, and the key's index entries before it, of rows
 * published and not vacuumed away yet, are not read.  Only the keys that
 * have a blocking row are kept (the lateral join drops the others), so that
 * in the common case, nothing held back, the anti-join below reads an empty
 * list rather than one row per key for each row.  A row without a key
 * meets no blocking row (NULL equals nothing).  Whether a row the walk
 * meets is taken is asked of $1 as a set (IN, hashed), not by = ANY,
 * which reads the array from its start for each row: the walk meets about
 * as many rows as were taken, so that was quadratic in them.
 *
 * outbox_ack.c reads the same check from the indexes, a descent per key
 * rather than a rescan of this plan per key; this statement (ACK_CHECK) is
 * what runs where it cannot (indexes other than it expects, as at 1.0, or
 * a shard of a distributed outbox).  Either way the answer, read under one
 * snapshot, goes through the same hold and write (ACK_CHECKED_WHERE: see
 * acknowledge_on in outbox/outbox.c).
 */
/*
 * The fence: a row is taken under the hand-out that attempts ($3) gives
 * beside its id in $1, the first position of the id where it is there
 * twice (array_position's answer).  Written as a row IN a set of pairs,
 * which the planner hashes, rather than a look-up of array_position for
 * each row, which read $1 from its start for each row: a fenced ack of
 * 40,000 rows took 17.6 s, against 0.2 s unfenced.  The IN is inside
 * coalesce() so that it stays a subplan, hashed, whatever the statistics:
 * at the top of the WHERE the planner makes it a semi-join, which a kept
 * plan, estimated for a few ids, may run as a nested loop that sorts the
 * pairs again for each row (a differential fuzz run's ack of stale fences
 * hit the 60 s statement timeout in C, where the SQL edition, whose IN
 * is under an OR, answered at once).
 */
#define ACK_FENCE(alias) \
	" AND coalesce((" alias ".id, " alias ".attempts) IN (" \
	"  SELECT DISTINCT ON (p.id) p.id, p.attempts" \
	"  FROM unnest($1, $3) WITH ORDINALITY AS p (id, attempts, n) ORDER BY p.id, p.n), false)"
#define ACK_BLOCKING(fence) \
	"WITH taken AS MATERIALIZED (" \
	"  SELECT a.topic, a.key, max(a.id) AS newest FROM idempotency.outbox a" \
	"  WHERE a.id = ANY ($1) AND a.key IS NOT NULL GROUP BY a.topic, a.key" \
	"), oldest AS MATERIALIZED (" \
	"  SELECT t.topic, (SELECT u.id FROM idempotency.outbox u" \
	"                   WHERE u.topic = t.topic" \
	"                     AND u.state <> 'published' AND u.published_at IS NULL" \
	"                   ORDER BY u.id LIMIT 1) AS id" \
	"  FROM (SELECT DISTINCT topic FROM taken) t" \
	"), blocking AS MATERIALIZED (" \
	"  SELECT k.topic, k.key, b.id" \
	"  FROM taken k JOIN oldest f ON f.topic = k.topic" \
	"  CROSS JOIN LATERAL (" \
	"      SELECT e.id FROM idempotency.outbox e" \
	"      WHERE e.topic = k.topic AND e.key = k.key" \
	"        AND e.id >= f.id AND e.id < k.newest" \
	"        AND e.state <> 'published' AND e.published_at IS NULL" \
	"        AND NOT coalesce(e.id IN (SELECT unnest($1)) AND e.state = 'leased'" fence("e") ", false)" \
	"      ORDER BY e.id LIMIT 1) b" \
	") "
#define ACK_WHERE(fence) \
	"o.id = ANY ($1) AND o.state = 'leased'" fence("o") \
	" AND NOT EXISTS (" \
	"      SELECT FROM blocking b" \
	"      WHERE b.topic = o.topic AND b.key = o.key AND b.id < o.id)"
#define NO_FENCE(alias) ""
/*
 * The rows of $4, the ids of $1 that the check found not held back by
 * their key (or, to hold, those of them that come before another of their
 * key), that are leased (and still under the hand-out named).
 */
#define ACK_CHECKED_WHERE(fence) \
	"o.id = ANY ($4) AND o.state = 'leased'" fence("o")

/*
 * A nack: the row (if it is leased, under the hand-out that returned it
 * with the fenced form) has failed one more try, and is pending again after
 * a backoff, or dead after its last try; the later rows of its key in the
 * same hand-out go back to pending at once, their hand-out not counted as a
 * failure (they were never tried).  The rows of one hand-out of a key share
 * their lease's end (available_at), which tells them from the rows of any
 * other: a later hand-out of the key starts after this one's lease ran out,
 * and so ends later.  Their attempts stay as the hand-out left them, and
 * the next hand-out counts one more: a fence (attempts) is never handed out
 * twice.  NACK_SQL_1_1 is 1.1's, for a database not updated yet, whose
 * attempts count the failures too: the put-back took the hand-out back
 * (attempts - 1), and the next hand-out repeated the fence.
 */
#define NACK_TARGET(fence) \
	"WITH target AS (" \
	"  SELECT id, topic, key, available_at FROM idempotency.outbox" \
	"  WHERE id = $1 AND state = 'leased'" fence \
	"  FOR UPDATE" \
	")"
#define NACK_RELEASED(attempts) \
	", released AS (" \
	"  UPDATE idempotency.outbox o" \
	"  SET state = 'pending', " attempts "available_at = $3" \
	"  FROM target t" \
	"  WHERE o.topic = t.topic AND o.key = t.key AND o.id > t.id" \
	"    AND o.state = 'leased' AND o.published_at IS NULL AND o.available_at = t.available_at" \
	"  RETURNING o.id" \
	")" \
	" SELECT id FROM nacked"
#define NACK_SQL(fence) \
	NACK_TARGET(fence) \
	", nacked AS (" \
	"  UPDATE idempotency.outbox o" \
	"  SET state = CASE WHEN o.failures + 1 >= $4 THEN 'dead' ELSE 'pending' END," \
	"      failures = o.failures + 1," \
	"      last_error = $2," \
	"      available_at = $3 + make_interval(secs => " \
	BACKOFF_MS_SQL("(o.failures + 1)", "$5", "$6") " / 1000.0)" \
	"  FROM target t WHERE o.id = t.id" \
	"  RETURNING o.id" \
	")" \
	NACK_RELEASED("")
#define NACK_SQL_1_1(fence) \
	NACK_TARGET(fence) \
	", nacked AS (" \
	"  UPDATE idempotency.outbox o" \
	"  SET state = CASE WHEN o.attempts >= $4 THEN 'dead' ELSE 'pending' END," \
	"      last_error = $2," \
	"      available_at = $3 + make_interval(secs => " \
	BACKOFF_MS_SQL("o.attempts", "$5", "$6") " / 1000.0)" \
	"  FROM target t WHERE o.id = t.id" \
	"  RETURNING o.id" \
	")" \
	NACK_RELEASED("attempts = greatest(o.attempts - 1, 0), ")

/*
 * The statements that decide on a row's failed tries, with try: which try
 * of the row the one in hand (leased, or failing now) is.  From 1.2 it is
 * one more than its failures; at 1.1, which counted failures and hand-outs
 * in one column, it was attempts (see statements_1_1).
 */
#define FETCH_HEADS_SQL(try) \
	"SELECT o.id, o.key, o.state = 'leased' AND " try " >= $5 AS exhausted" \
	" FROM idempotency.outbox o" \
	" WHERE o.id = ANY ($8) AND o.state IN ('pending', 'leased')" \
	"   AND o.published_at IS NULL AND o.available_at <= $4" \
	" ORDER BY o.id" \
	" FOR UPDATE OF o SKIP LOCKED"
#define FETCH_FOLLOWERS_SQL(try) \
	"SELECT o.id, o.available_at <= $4" \
	"        AND (o.state = 'pending' OR (o.state = 'leased' AND " try " < $5)) AS ready" \
	" FROM idempotency.outbox o" \
	" WHERE o.topic = $1 AND o.key = $6 AND o.id > $7" \
	"   AND o.state <> 'published' AND o.published_at IS NULL" \
	" ORDER BY o.id LIMIT $2" \
	" FOR UPDATE OF o"
#define FETCH_LEASE_SQL(try, count_failure) \
	"WITH handed_out AS (" \
	"  UPDATE idempotency.outbox o" \
	"  SET state = CASE WHEN o.state = 'leased' AND " try " >= $5 THEN 'dead' ELSE 'leased' END," \
	"      attempts = CASE WHEN o.state = 'leased' AND " try " >= $5 THEN o.attempts" \
	"                      ELSE o.attempts + 1 END," \
	count_failure \
	"      last_error = CASE WHEN o.state = 'leased' AND " try " >= $5" \
	"                        THEN 'lease ran out without acknowledgement' ELSE o.last_error END," \
	"      available_at = $4 + $3" \
	"  WHERE o.id = ANY ($8)" \
	"  RETURNING o.*" \
	")" \
	" SELECT * FROM handed_out WHERE state = 'leased' ORDER BY id"
#define REQUEUE_SQL(reset) \
	"UPDATE idempotency.outbox SET state = 'pending', " reset ", available_at = $2" \
	" WHERE id = $1 AND state = 'dead'"
#define PUBLISH_FAILED_SQL(try, count_failure) \
	"UPDATE idempotency.outbox" \
	" SET attempts = attempts + 1," \
	count_failure \
	"     state = CASE WHEN " try " >= $4 THEN 'dead' ELSE 'pending' END," \
	"     last_error = $2," \
	"     available_at = $3 + make_interval(secs => " \
	BACKOFF_MS_SQL("(" try ")", "$5", "$6") " / 1000.0)" \
	" WHERE id = $1 AND state = 'pending'"

typedef struct StatementDef
{
	const char *sql;
	int			nargs;
	Oid			argtypes[8];
	IdemPlanMode plan;			/* custom, generic or plancache.c's choice */
	bool		walk_in_order;	/* planned under infra/plan_settings.c's
								 * walk_in_order_settings */
} StatementDef;

/*
 * The pull API's statements (STMT_FETCH_*): walk_in_order, and one generic
 * plan per backend, built at the first call.
 *
 * Left to plancache.c, a kept statement gets a custom plan for each of its
 * first five executions, planned for the topic given: for a topic with a
 * backlog, the planner reckoned that reading all its unpublished rows
 * (the cursor of STMT_FETCH_SCAN has no LIMIT: it is read a chunk at a
 * time, as far as the batch needs) cost less by a sequential or bitmap
 * scan and a sort than by the index, so that each of a new connection's
 * first five fetches read and sorted the whole backlog (36 ms at 50,000
 * rows, against 1.3 ms after).  A generic plan, with its estimates made
 * without the parameters, came out as the walk of the index; but not
 * always: its estimates come from the statistics, so that after an
 * autoanalyze the heads' statement was seen (issue 29) to switch to a
 * bitmap scan, and, with statistics taken on a nearly empty table, a new
 * connection's first fetch took 79 ms and its kept plan three times the
 * steady fetch.  So the plan is generic from the first call
 * (CURSOR_OPT_GENERIC_PLAN, and plan_cache_mode, which overrides that
 * option, set too), and it is planned, whenever plancache.c builds it
 * (the first call, and the first after an invalidation: an ANALYZE, a
 * VACUUM, DDL), under walk_in_order_settings: what is left is the walk of
 * outbox_ready (the scan; at 1.1 or the primary key, the same columns,
 * when the statistics cannot tell them apart), outbox_key_order (the
 * followers of a key) and the primary key (the heads and the lease, by
 * id; at 1.1 outbox_id), in order, and the cursor's reads stop where the
 * batch is full.  The cost of a fetch
 * is then that of its batch, whatever the backlog and whatever the
 * statistics say.  The settings are made around each run, since whether
 * plancache.c will plan again is only known inside it (an invalidation
 * may arrive as the statement takes its locks); their cost, a few
 * set_config_option calls, is a few microseconds against a fetch's
 * milliseconds.  A walk of the index in C was not taken: it would read
 * the same entries as these plans now do, and save the executor's share
 * of a fetch only, where issue 29 keeps a bypass of the executor only if
 * it earns 1.2 times the kept plan on a make bench line.
 *
 * The same (WALK_PLAN) for the statements that find their rows by id (the
 * ack's, nack, requeue, discard, and publishing's writes of a batch's
 * rows), and for publishing's walks and its purge: one generic plan,
 * under walk_in_order, which leaves them the primary key (and, for
 * the ack's order check and the nack's put-back, the walks of outbox_ready
 * and outbox_key_order by topic and key).  Left to plancache.c, a plan
 * made while the outbox was nearly empty (just after a vacuum truncated
 * it, as it is when relays keep up) was kept however much the table grew
 * until the next ANALYZE: the worker's delete of a batch's rows as a
 * sequential scan of the whole table, 1,200 buffers a batch on 15.20
 * (pg_stat_user_tables.seq_scan one per batch), and a relay's ack of 100
 * rows taking 10 ms against 0.6 ms once 100,000 rows had come in.
 */
#define WALK_PLAN .plan = IDEM_PLAN_GENERIC, .walk_in_order = true

static const StatementDef statements[NUM_STATEMENTS] = {
	/*
	 * The pull API's statements are planned once per backend (a generic
	 * plan): what they read is bounded by their parameters (a batch, a key,
	 * a list of ids), not by how large the outbox is, and a plan made for
	 * each call cost more than the rest of the call.  They share one list of
	 * parameters (FETCH_* in outbox_sql.h), each using those it needs.
	 *
	 * The heads of a topic, in two steps.  First its unpublished rows,
	 * oldest first, read without a lock through a cursor: the caller walks
	 * them in id order, so it meets every earlier unpublished row of a key
	 * (pending, leased, dead) before the key's later rows, and knows a
	 * key's head as the first row of the key it meets, without a look into
	 * the key's index per row.  state and published_at say the same of
	 * every row; both are named so that the partial indexes of 1.0 (on
	 * state) and of 1.1 (on published_at) both serve.
	 */
	[STMT_FETCH_SCAN] = {
		"SELECT o.id, o.key, o.state IN ('pending', 'leased') AND o.available_at <= $4 AS ready"
		" FROM idempotency.outbox o"
		" WHERE " ONE_TOPIC("$1") " AND o.state <> 'published' AND o.published_at IS NULL"
		" ORDER BY o.topic, o.id",
		FETCH_NARGS, FETCH_ARGTYPES, WALK_PLAN
	},

	/*
	 * Then the ready heads among them ($8), locked, skipping rows another
	 * relay is taking right now.  A head stays the head of its key: an
	 * earlier row of a key is never inserted later (enqueuers of a key are
	 * serialised before their rows get ids), nor is a published row ever
	 * unpublished again.
	 */
	[STMT_FETCH_HEADS] = {
		FETCH_HEADS_SQL("o.failures + 1"),
		FETCH_NARGS, FETCH_ARGTYPES, WALK_PLAN
	},

	/*
	 * The unpublished rows of a key after its head ($7), oldest first, up to
	 * $2, each saying whether it is ready; the caller takes them up to the
	 * first that is not.  Locked waiting: no other hand-out can hold them
	 * while we hold the head, so a lock here is a statement's (an ack, a
	 * nack) for the moment it runs.
	 */
	[STMT_FETCH_FOLLOWERS] = {
		FETCH_FOLLOWERS_SQL("o.failures + 1"),
		FETCH_NARGS, FETCH_ARGTYPES, WALK_PLAN
	},

	/*
	 * Lease the rows chosen ($8), locked by the statements above: one more
	 * hand-out each (attempts), until $4 + $3.  A leased row whose lease ran
	 * out unacknowledged failed its try: counted (failures), and dead
	 * instead after its last.  None of the columns written is indexed (see
	 * the update script), so this is a HOT update where the page has room.
	 */
	[STMT_FETCH_LEASE] = {
		FETCH_LEASE_SQL("o.failures + 1",
						"      failures = CASE WHEN o.state = 'leased' THEN o.failures + 1"
						"                      ELSE o.failures END,"),
		FETCH_NARGS, FETCH_ARGTYPES, WALK_PLAN
	},

	/*
	 * Acknowledgements, in three steps (see acknowledge_on in outbox/outbox.c):
	 * $1 ids, $2 now, $3 attempts (the fenced forms), $4 ids the check let
	 * through.  First the order check, where outbox_ack.c cannot read it
	 * from the indexes: the rows of $1 that may be acknowledged, leased (and
	 * under the hand-out named), by key, oldest first.
	 */
	[STMT_ACK_CHECK] = {
		ACK_BLOCKING(NO_FENCE) "SELECT o.id, o.topic, o.key FROM idempotency.outbox o"
		" WHERE " ACK_WHERE(NO_FENCE) " ORDER BY o.topic, o.key, o.id",
		4, {INT8ARRAYOID, TIMESTAMPTZOID, INT4ARRAYOID, INT8ARRAYOID}, WALK_PLAN
	},
	[STMT_ACK_FENCED_CHECK] = {
		ACK_BLOCKING(ACK_FENCE) "SELECT o.id, o.topic, o.key FROM idempotency.outbox o"
		" WHERE " ACK_WHERE(ACK_FENCE) " ORDER BY o.topic, o.key, o.id",
		4, {INT8ARRAYOID, TIMESTAMPTZOID, INT4ARRAYOID, INT8ARRAYOID}, WALK_PLAN
	},

	/*
	 * Then, if the check let through two or more rows of a key, the rows
	 * that come before another of their key ($4) are locked, in id order,
	 * and those still taken returned: under READ COMMITTED a row changed
	 * since the check's snapshot is read again as it is now (as an UPDATE
	 * reads the row it writes), so that a row another relay leased again
	 * meanwhile is not returned, and the rows of its key after it are left
	 * out of the write; under REPEATABLE READ, such a row fails the lock
	 * with 40001, as any write of it would.
	 */
	[STMT_ACK_HOLD] = {
		"SELECT o.id FROM idempotency.outbox o WHERE " ACK_CHECKED_WHERE(NO_FENCE)
		" ORDER BY o.id FOR UPDATE OF o",
		4, {INT8ARRAYOID, TIMESTAMPTZOID, INT4ARRAYOID, INT8ARRAYOID}, WALK_PLAN
	},
	[STMT_ACK_FENCED_HOLD] = {
		"SELECT o.id FROM idempotency.outbox o WHERE " ACK_CHECKED_WHERE(ACK_FENCE)
		" ORDER BY o.id FOR UPDATE OF o",
		4, {INT8ARRAYOID, TIMESTAMPTZOID, INT4ARRAYOID, INT8ARRAYOID}, WALK_PLAN
	},

	/*
	 * Then the write, of the rows let through ($4) that are still taken: a
	 * row is tested as it is now (READ COMMITTED), and whichever of them
	 * another relay took meanwhile is left; the rows of a key that come
	 * after another are held, and cannot have changed.
	 */
	[STMT_ACK_CHECKED_DELETE] = {
		"DELETE FROM idempotency.outbox o WHERE " ACK_CHECKED_WHERE(NO_FENCE),
		4, {INT8ARRAYOID, TIMESTAMPTZOID, INT4ARRAYOID, INT8ARRAYOID}, WALK_PLAN
	},
	[STMT_ACK_CHECKED_KEEP] = {
		"UPDATE idempotency.outbox o SET state = 'published', published_at = $2"
		" WHERE " ACK_CHECKED_WHERE(NO_FENCE),
		4, {INT8ARRAYOID, TIMESTAMPTZOID, INT4ARRAYOID, INT8ARRAYOID}, WALK_PLAN
	},
	[STMT_ACK_CHECKED_FENCED_DELETE] = {
		"DELETE FROM idempotency.outbox o WHERE " ACK_CHECKED_WHERE(ACK_FENCE),
		4, {INT8ARRAYOID, TIMESTAMPTZOID, INT4ARRAYOID, INT8ARRAYOID}, WALK_PLAN
	},
	[STMT_ACK_CHECKED_FENCED_KEEP] = {
		"UPDATE idempotency.outbox o SET state = 'published', published_at = $2"
		" WHERE " ACK_CHECKED_WHERE(ACK_FENCE),
		4, {INT8ARRAYOID, TIMESTAMPTZOID, INT4ARRAYOID, INT8ARRAYOID}, WALK_PLAN
	},

	/*
	 * $1 id, $2 error, $3 now, $4 max attempts, $5 backoff min, $6 backoff
	 * max, $7 attempt (the fenced form).
	 */
	[STMT_NACK] = {
		NACK_SQL(""),
		7, {INT8OID, TEXTOID, TIMESTAMPTZOID, INT4OID, INT4OID, INT4OID, INT4OID}, WALK_PLAN
	},
	[STMT_NACK_FENCED] = {
		NACK_SQL(" AND attempts = $7"),
		7, {INT8OID, TEXTOID, TIMESTAMPTZOID, INT4OID, INT4OID, INT4OID, INT4OID}, WALK_PLAN
	},

	[STMT_REQUEUE] = {
		REQUEUE_SQL("failures = 0"),
		2, {INT8OID, TIMESTAMPTZOID}, WALK_PLAN
	},
	[STMT_DISCARD] = {
		"DELETE FROM idempotency.outbox WHERE id = $1 AND state = 'dead'",
		1, {INT8OID}, WALK_PLAN
	},
	/*
	 * A new pending row, its id given (idem_outbox_next_id), and the rows of
	 * a batch from arrays of equal length; failures takes its default (1.2).
	 */
	[STMT_ENQUEUE] = {
		"INSERT INTO idempotency.outbox (id, topic, key, payload, headers, created_at,"
		" state, attempts, available_at)"
		" VALUES ($1, $2, $3, $4, $5, $6, 'pending', 0, $6)",
		6, {INT8OID, TEXTOID, TEXTOID, JSONBOID, JSONBOID, TIMESTAMPTZOID}
	},
	[STMT_ENQUEUE_BATCH] = {
		"INSERT INTO idempotency.outbox (id, topic, key, payload, headers, created_at,"
		" state, attempts, available_at)"
		" SELECT r.id, $2, r.key, r.payload, r.headers, $6, 'pending', 0, $6"
		" FROM unnest($1, $3, $4, $5) AS r (id, key, payload, headers)",
		6, {INT8ARRAYOID, TEXTOID, TEXTARRAYOID, JSONBARRAYOID, JSONBARRAYOID, TIMESTAMPTZOID}
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
	 *
	 * The topic's walk is one generic plan, as the pull API's statements
	 * (WALK_PLAN): under walk_in_order it is the walk of outbox_ready from
	 * ($3, $4), whatever the statistics.  A plan for each batch cost more
	 * than the batch: planning "o.id > $4" for a value past the statistics'
	 * histogram makes the planner look up the actual ends of the id column
	 * in the indexes (get_actual_variable_range), over the entries of rows
	 * published since the last vacuum: 0.46 ms and about 500 buffers a
	 * batch on 15.20 with one client enqueuing (pg_stat_statements,
	 * track_planning), against 0.11 ms to run it.
	 */
	[STMT_PUBLISH_CANDIDATES_TOPIC] = {
		PUBLISH_CANDIDATES_SQL(ONE_TOPIC("$3") " AND o.id > $4", "o.topic, o.id"),
		4, {TIMESTAMPTZOID, INT4OID, TEXTOID, INT8OID}, WALK_PLAN
	},
	/*
	 * The walk across the topics, with a default route: $3 the topics
	 * routed to none.  The same WALK_PLAN: the walk of the primary key
	 * (1.1: outbox_id), the only index in id order across topics, from $4.
	 * Left a custom plan for each batch, it was planned anew each time (0.25
	 * ms and some 500 buffers, against 0.5 ms to run it, for a few rows);
	 * and with statistics taken while the outbox held mostly published rows
	 * kept for outbox_retention, the planner reckoned few rows unpublished
	 * and read all of outbox_ready, probed the key of each and sorted them:
	 * 76 ms a batch of 100 with a backlog of 50,000 (15.18), against 1 ms.
	 * The walk starts where STMT_PUBLISH_OLDEST_EXCEPT says, past the
	 * published rows kept at the front of the primary key.
	 */
	[STMT_PUBLISH_CANDIDATES_EXCEPT] = {
		PUBLISH_CANDIDATES_SQL("o.topic <> ALL ($3) AND o.id > $4", "o.id"),
		4, {TIMESTAMPTZOID, INT4OID, TEXTARRAYOID, INT8OID}, WALK_PLAN
	},
	/* one row, by id ($3), if it is still a candidate (see outbox_publish_row) */
	[STMT_PUBLISH_CANDIDATE_ROW] = {
		PUBLISH_CANDIDATES_SQL("o.id = $3", "o.id"),
		3, {TIMESTAMPTZOID, INT4OID, INT8OID}, WALK_PLAN
	},
	/*
	 * Where a round of the worker starts its walk of a topic ($1): the
	 * topic's oldest row after $2 that is pending or leased (a dead one
	 * waits for a requeue, which tells the worker: see publish.c's
	 * before_batch).
	 */
	[STMT_PUBLISH_OLDEST] = {
		"SELECT o.id FROM idempotency.outbox o"
		" WHERE " ONE_TOPIC("$1") " AND o.id > $2 AND " STILL_TO_GO
		" ORDER BY o.topic, o.id LIMIT 1",
		2, {TEXTOID, INT8OID}, WALK_PLAN
	},
	/*
	 * The same for the walk across the topics (STMT_PUBLISH_CANDIDATES_EXCEPT),
	 * when a round starts afresh: the oldest row still to go of any topic
	 * but those routed to none ($1).  No index holds only those rows in id
	 * order across topics, so each topic that has any is found in
	 * outbox_ready (topic, id), one descent each (a loose index scan), and
	 * its oldest looked up there.  With none, the walk starts past the
	 * newest row (a published one, or a dead one, which a requeue tells of)
	 * rather than read the published rows kept from the first entry on.
	 * Each topic costs the loose scan two descents (10,000 topics with a row
	 * each: 44 ms on 15.18), so it gives up at OLDEST_TOPICS_MAX topics
	 * (NULL: the walk starts at the first entry, as it did before).  It also
	 * reads each topic's entries of the rows published since the last
	 * vacuum, so a round that starts where the last one did looks on from
	 * there in id order instead (STMT_PUBLISH_NEXT_EXCEPT, after $2), past
	 * the rows published since, which that round's batches walked already.
	 */
	[STMT_PUBLISH_OLDEST_EXCEPT] = {
		"WITH RECURSIVE topics(topic, n) AS ("
		"  (SELECT o.topic, 1 FROM idempotency.outbox o WHERE " STILL_TO_GO
		"   ORDER BY o.topic LIMIT 1)"
		"  UNION ALL"
		"  SELECT (SELECT o.topic FROM idempotency.outbox o"
		"          WHERE o.topic > t.topic AND " STILL_TO_GO
		"          ORDER BY o.topic LIMIT 1), t.n + 1"
		"  FROM topics t WHERE t.topic IS NOT NULL AND t.n < " OLDEST_TOPICS_MAX
		")"
		", oldest(id) AS ("
		"  SELECT min(f.id) FROM topics t"
		"  CROSS JOIN LATERAL (SELECT o.id FROM idempotency.outbox o"
		"                      WHERE " ONE_TOPIC("t.topic") " AND " STILL_TO_GO
		"                      ORDER BY o.topic, o.id LIMIT 1) f"
		"  WHERE t.topic <> ALL ($1)"
		")"
		" SELECT CASE WHEN NOT EXISTS (SELECT FROM topics t"
		"                              WHERE t.n = " OLDEST_TOPICS_MAX " AND t.topic IS NOT NULL)"
		"             THEN coalesce(oldest.id, " PAST_THE_NEWEST ") END"
		" FROM oldest",
		1, {TEXTARRAYOID}, WALK_PLAN
	},
	[STMT_PUBLISH_NEXT_EXCEPT] = {
		"SELECT coalesce((SELECT o.id FROM idempotency.outbox o"
		"                 WHERE o.id > $2 AND o.topic <> ALL ($1) AND " STILL_TO_GO
		"                 ORDER BY o.id LIMIT 1), " PAST_THE_NEWEST ")",
		2, {TEXTARRAYOID, INT8OID}, WALK_PLAN
	},
	[STMT_ROUTES] = {
		"SELECT topic, target <> 'none' AS routed FROM idempotency.outbox_routes",
		0, {}
	},
	[STMT_MARK_PUBLISHED_DELETE] = {
		"DELETE FROM idempotency.outbox WHERE id = ANY ($1)",
		1, {INT8ARRAYOID}, WALK_PLAN
	},
	[STMT_MARK_PUBLISHED_KEEP] = {
		"UPDATE idempotency.outbox"
		" SET state = 'published', published_at = $2, attempts = attempts + 1"
		" WHERE id = ANY ($1)",
		2, {INT8ARRAYOID, TIMESTAMPTZOID}, WALK_PLAN
	},
	/*
	 * The rows whose NOTIFY went out truncated (a reference the listener
	 * reads the row by), kept whatever outbox_retention says: marked by
	 * available_at 'infinity', which no other published row has (it says
	 * when a pending row may go, and a leased one's lease ends), so that the
	 * purge keeps them for idempotency.notify_truncated_retention however
	 * the route or the settings change meanwhile.  available_at is in no
	 * index, and a published row's is read by nothing else.
	 */
	[STMT_MARK_PUBLISHED_TRUNCATED] = {
		"UPDATE idempotency.outbox"
		" SET state = 'published', published_at = $2, attempts = attempts + 1,"
		"     available_at = 'infinity'"
		" WHERE id = ANY ($1)",
		2, {INT8ARRAYOID, TIMESTAMPTZOID}, WALK_PLAN
	},
	/*
	 * $1 id, $2 error, $3 now, $4 max attempts, $5 backoff min, $6 backoff
	 * max.  Only a pending row: a batch's candidates are, and locked, but a
	 * row whose attempt is recorded after its transaction failed
	 * (outbox_record_failure) may have been requeued, discarded or leased by
	 * then.
	 */
	[STMT_PUBLISH_FAILED] = {
		PUBLISH_FAILED_SQL("failures + 1", "      failures = failures + 1,"),
		6, {INT8OID, TEXTOID, TIMESTAMPTZOID, INT4OID, INT4OID, INT4OID}, WALK_PLAN
	},
	/*
	 * $1 published before (outbox_retention), $2 batch size, $3 published
	 * before (notify_truncated_retention): the rows whose NOTIFY went out
	 * truncated (STMT_MARK_PUBLISHED_TRUNCATED) go once both have passed.
	 * A walk of outbox_published from its oldest entry, stopping at the
	 * batch: the rows past both come first and each is deleted; only once
	 * they are gone does a batch read past the truncated rows still kept,
	 * when outbox_retention is the shorter and not 0 (see
	 * outbox_purge_published).  The ids are gathered first (ARRAY, run
	 * once) and the rows then found by the primary key, under
	 * walk_in_order: with "id IN (...)" the planner joined the ids to a
	 * scan of the whole table (18, a generic plan), which, before it found
	 * there was nothing to delete, read every dead row at its front.
	 */
	[STMT_PURGE_PUBLISHED] = {
		"DELETE FROM idempotency.outbox WHERE id = ANY (ARRAY("
		"  SELECT id FROM idempotency.outbox"
		"  WHERE state = 'published' AND published_at <= $1"
		"    AND (published_at <= $3 OR available_at <> 'infinity')"
		"  ORDER BY published_at LIMIT $2 FOR UPDATE SKIP LOCKED))",
		3, {TIMESTAMPTZOID, INT4OID, TIMESTAMPTZOID}, WALK_PLAN
	},
};

/*
 * The statements whose text differs in a database still at 1.1 (no failures
 * column): attempts counted the failed tries as well as the hand-outs, a
 * requeue reset it, and a nack's put-back took its hand-out back.  Their
 * fences could repeat: the reason for 1.2.
 */
static const char *const statements_1_1[NUM_STATEMENTS] = {
	[STMT_FETCH_HEADS] = FETCH_HEADS_SQL("o.attempts"),
	[STMT_FETCH_FOLLOWERS] = FETCH_FOLLOWERS_SQL("o.attempts"),
	[STMT_FETCH_LEASE] = FETCH_LEASE_SQL("o.attempts", ""),
	[STMT_NACK] = NACK_SQL_1_1(""),
	[STMT_NACK_FENCED] = NACK_SQL_1_1(" AND attempts = $7"),
	[STMT_REQUEUE] = REQUEUE_SQL("attempts = 0"),
	[STMT_PUBLISH_FAILED] = PUBLISH_FAILED_SQL("attempts + 1", ""),
};

/*
 * Plans prepared on first use and kept for the backend's life, one set per
 * schema (OutboxSchema): the 1.1 set is used until the database is updated.
 */
static SPIPlanPtr plans[NUM_OUTBOX_SCHEMAS][NUM_STATEMENTS];

/* The schema of the database the statements run in now (outbox_sql_begin_on). */
static OutboxSchema outbox_schema = OUTBOX_SCHEMA_1_2;

/*
 * The plans of the statements on one shard of a distributed outbox, kept
 * for the backend's life too, by the shard's OID, with the tables their text
 * names (see statement_on_shard): the names they had when planned tell a
 * shard from another that got its OID since, and a routes placement from
 * one that replaced it.
 */
typedef struct ShardPlans
{
	Oid			shard;			/* hash key */
	NameData	name;
	Oid			routes;			/* this node's placement of the routes, if any */
	NameData	routes_name;
	SPIPlanPtr	plans[NUM_OUTBOX_SCHEMAS][NUM_STATEMENTS];
} ShardPlans;

static HTAB *shard_plans;

/* Where the statements run now: a shard's plans, or NULL for the tables. */
static ShardPlans *current_shard;

/*
 * For each context begun and not ended, innermost last: where the
 * statements ran before it, and the (sub)transaction it was begun in.  A
 * context is begun inside another's when a route's function (or a trigger)
 * calls the pull API: if the inner one fails, and a subtransaction catches
 * the error (the function's EXCEPTION block, the careful publishing's), its
 * outbox_sql_end never runs, and the subtransaction's abort takes the
 * statements back where they ran before the first context it began; else
 * the outer one's next statements (a batch's published mark) would run on
 * the inner one's shard.
 */
typedef struct BegunContext
{
	int			nest_level;
	ShardPlans *outer_shard;
} BegunContext;

static BegunContext *begun;
static int	nbegun;
static int	begun_capacity;

static void
forget_begun_on_abort(XactEvent event, void *arg)
{
	if (event == XACT_EVENT_ABORT || event == XACT_EVENT_PARALLEL_ABORT)
	{
		nbegun = 0;
		current_shard = NULL;
	}
}

static void
forget_begun_on_subabort(SubXactEvent event, SubTransactionId subid,
						 SubTransactionId parent, void *arg)
{
	/* the contexts begun in the subtransaction being aborted, or deeper */
	if (event == SUBXACT_EVENT_ABORT_SUB)
		while (nbegun > 0 && begun[nbegun - 1].nest_level >= GetCurrentTransactionNestLevel())
			current_shard = begun[--nbegun].outer_shard;
}

/* Note a context begun, for the aborts above. */
static void
push_begun(void)
{
	if (begun == NULL)
	{
		begun_capacity = 8;
		begun = MemoryContextAlloc(TopMemoryContext, sizeof(BegunContext) * begun_capacity);
		RegisterXactCallback(forget_begun_on_abort, NULL);
		RegisterSubXactCallback(forget_begun_on_subabort, NULL);
	}
	else if (nbegun >= begun_capacity)
	{
		begun_capacity *= 2;
		begun = repalloc(begun, sizeof(BegunContext) * begun_capacity);
	}
	begun[nbegun].nest_level = GetCurrentTransactionNestLevel();
	begun[nbegun++].outer_shard = current_shard;
}

/* Note the innermost context ended: the statements run where they ran before it. */
static void
pop_begun(void)
{
	Assert(nbegun > 0);
	current_shard = begun[--nbegun].outer_shard;
}

/* Is the relation still there, named name? */
static bool
still_named(Oid relid, const NameData *name)
{
	char	   *now = get_rel_name(relid);
	bool		same = now != NULL && strcmp(now, NameStr(*name)) == 0;

	if (now != NULL)
		pfree(now);
	return same;
}

/* Are the tables that the entry's statements name still those? */
static bool
plans_still_valid(const ShardPlans *entry)
{
	return still_named(entry->shard, &entry->name) &&
		(!OidIsValid(entry->routes) || still_named(entry->routes, &entry->routes_name));
}

static bool
plans_in_use(const ShardPlans *entry)
{
	if (entry == current_shard)
		return true;
	for (int i = 0; i < nbegun; i++)
		if (begun[i].outer_shard == entry)
			return true;
	return false;
}

static void
free_plans(ShardPlans *entry)
{
	for (int schema = 0; schema < NUM_OUTBOX_SCHEMAS; schema++)
		for (int i = 0; i < NUM_STATEMENTS; i++)
			if (entry->plans[schema][i] != NULL)
				SPI_freeplan(entry->plans[schema][i]);
}

/*
 * Free the plans of the shards whose tables are gone or renamed (a shard
 * moved away, and dropped by Citus), but those of the contexts begun, which
 * hold their shard locked: without this, a backend that lives through shard
 * moves and splits (the worker) kept the plans of every shard it ever
 * published, and a routes placement replaced left its shards' statements
 * naming a table that no longer exists.
 */
static void
forget_gone_shards(void)
{
	HASH_SEQ_STATUS status;
	ShardPlans *entry;

	hash_seq_init(&status, shard_plans);
	while ((entry = hash_seq_search(&status)) != NULL)
	{
		if (plans_in_use(entry) || plans_still_valid(entry))
			continue;
		free_plans(entry);
		(void) hash_search(shard_plans, &entry->shard, HASH_REMOVE, NULL);
	}
}

/*
 * The plans of shard, as it is named now; planned again if a table they
 * name is renamed or replaced.
 */
static ShardPlans *
plans_of_shard(Oid shard)
{
	ShardPlans *entry;
	bool		found;
	Oid			routes;
	List	   *placements;

	if (shard_plans == NULL)
	{
		HASHCTL		ctl;

		ctl.keysize = sizeof(Oid);
		ctl.entrysize = sizeof(ShardPlans);
		ctl.hcxt = TopMemoryContext;
		shard_plans = hash_create("idempotency outbox shard plans", 16, &ctl,
								  HASH_ELEM | HASH_BLOBS | HASH_CONTEXT);
	}
	/* (a context begun on the shard already is running them: kept) */
	entry = hash_search(shard_plans, &shard, HASH_FIND, NULL);
	if (entry != NULL && (plans_in_use(entry) || plans_still_valid(entry)))
		return entry;

	forget_gone_shards();
	entry = hash_search(shard_plans, &shard, HASH_ENTER, &found);
	if (found)
		free_plans(entry);
	memset(entry->plans, 0, sizeof(entry->plans));
	namestrcpy(&entry->name, get_rel_name(shard));
	routes = get_relname_relid("outbox_routes", get_rel_namespace(shard));
	placements = OidIsValid(routes) ? idem_local_shards(routes) : NIL;
	entry->routes = InvalidOid;
	if (placements != NIL)
	{
		char	   *routes_name = get_rel_name(linitial_oid(placements));

		if (routes_name != NULL)
		{
			entry->routes = linitial_oid(placements);
			namestrcpy(&entry->routes_name, routes_name);
		}
	}
	return entry;
}

/*
 * The text of a statement on a shard: idempotency.outbox becomes the
 * shard, idempotency.outbox_routes this node's placement of the routes
 * (or stays, for Citus to find, on a node without one).
 */
static char *
statement_on_shard(const char *sql, const ShardPlans *shard)
{
	static const char table[] = "idempotency.outbox";
	static const char routes_suffix[] = "_routes";
	const char *schema = get_namespace_name(get_rel_namespace(shard->shard));
	const char *outbox_name = quote_qualified_identifier(schema, NameStr(shard->name));
	const char *routes_name = OidIsValid(shard->routes) ?
		quote_qualified_identifier(schema, NameStr(shard->routes_name)) :
		"idempotency.outbox_routes";
	StringInfoData text;
	const char *rest = sql;
	const char *hit;

	initStringInfo(&text);
	while ((hit = strstr(rest, table)) != NULL)
	{
		appendBinaryStringInfo(&text, rest, hit - rest);
		rest = hit + strlen(table);
		if (strncmp(rest, routes_suffix, strlen(routes_suffix)) == 0)
		{
			appendStringInfoString(&text, routes_name);
			rest += strlen(routes_suffix);
		}
		else
			appendStringInfoString(&text, outbox_name);
	}
	appendStringInfoString(&text, rest);
	return text.data;
}

/*
 * Enter the context the outbox's statements run in: as the owner of the
 * extension's tables, with search_path pinned to pg_catalog (see
 * infra/run_as.c), connected to SPI.  An error on the way out of here is
 * cleaned up by the transaction's abort, which restores the user and the
 * settings.
 */
void
outbox_sql_begin(OutboxSqlContext *context)
{
	(void) outbox_sql_begin_on(context, InvalidOid);
}

/*
 * The same, for the statements to run on shard, one of this node's shards
 * of a distributed outbox (InvalidOid: the table itself).  The shard is
 * locked first, and its metadata as a write of Citus's would
 * (idem_lock_local_shard); if it is no longer placed here (moved away),
 * nothing is begun and false is returned.
 */
bool
outbox_sql_begin_on(OutboxSqlContext *context, Oid shard)
{
	int			natts;
	Oid			owner = idem_outbox_owner(&natts);

	/* 1.2's failures column, or a database still at 1.1 (its shards alike) */
	outbox_schema = natts >= Natts_outbox ? OUTBOX_SCHEMA_1_2 : OUTBOX_SCHEMA_1_1;

	push_begun();
	current_shard = NULL;
	idem_run_as_begin(&context->run_as, owner, SECURITY_LOCAL_USERID_CHANGE);
	if (OidIsValid(shard))
	{
		LockRelationOid(shard, RowExclusiveLock);
		if (!SearchSysCacheExists1(RELOID, ObjectIdGetDatum(shard)) ||
			!idem_lock_local_shard(shard))
		{
			/* moved away: its old table may still be here, for Citus to drop */
			idem_run_as_end(&context->run_as, false);
			pop_begun();
			return false;
		}
		current_shard = plans_of_shard(shard);
		/* a shard that missed the update's new column is served as at 1.1 */
		if (get_attnum(shard, "failures") == InvalidAttrNumber)
			outbox_schema = OUTBOX_SCHEMA_1_1;
	}
	if (SPI_connect() != SPI_OK_CONNECT)
		elog(ERROR, "SPI_connect failed");
	return true;
}

void
outbox_sql_end(OutboxSqlContext *context)
{
	SPI_finish();
	idem_run_as_end(&context->run_as, true);
	/* a route's function may have run statements of its own meanwhile */
	pop_begun();
}

/* The plan of one of the statements above, prepared on first use. */
SPIPlanPtr
outbox_plan(OutboxStatement statement)
{
	SPIPlanPtr *kept = current_shard != NULL ?
		current_shard->plans[outbox_schema] : plans[outbox_schema];

	if (kept[statement] == NULL)
	{
		const StatementDef *def = &statements[statement];
		const char *text = outbox_schema == OUTBOX_SCHEMA_1_1 &&
			statements_1_1[statement] != NULL ? statements_1_1[statement] : def->sql;
		const char *sql = current_shard != NULL ?
			statement_on_shard(text, current_shard) : text;
		SPIPlanPtr	plan = SPI_prepare_cursor(sql, def->nargs, (Oid *) def->argtypes,
											  idem_plan_cursor_options(def->plan));

		if (plan == NULL)
			elog(ERROR, "could not prepare outbox statement %d: %s",
				 (int) statement, SPI_result_code_string(SPI_result));
		if (SPI_keepplan(plan) != 0)
			elog(ERROR, "could not keep outbox statement %d", (int) statement);
		kept[statement] = plan;
	}
	return kept[statement];
}

/*
 * Run one of the statements above; returns SPI_processed.  Its planner
 * settings (idem_plan_settings_begin) are restored on the way out, and by
 * the (sub)transaction's abort after an error.
 */
uint64
outbox_sql_run(OutboxStatement statement, Datum *values, const char *nulls)
{
	SPIPlanPtr	plan = outbox_plan(statement);
	const StatementDef *def = &statements[statement];
	int			guc_nest_level = idem_plan_settings_begin(def->plan, def->walk_in_order);
	int			ret;

	ret = SPI_execute_plan(plan, values, nulls, false, 0);
	idem_plan_settings_end(guc_nest_level);

	if (ret < 0)
		elog(ERROR, "outbox statement %d failed: %s",
			 (int) statement, SPI_result_code_string(ret));
	return SPI_processed;
}

/*
 * Open a cursor on one of the statements above (planned then, under its
 * planner settings, which its later reads keep).
 */
Portal
outbox_sql_cursor_open(OutboxStatement statement, Datum *values, const char *nulls)
{
	SPIPlanPtr	plan = outbox_plan(statement);
	const StatementDef *def = &statements[statement];
	int			guc_nest_level = idem_plan_settings_begin(def->plan, def->walk_in_order);
	Portal		portal;

	portal = SPI_cursor_open(NULL, plan, values, nulls, false);
	idem_plan_settings_end(guc_nest_level);
	return portal;
}

/*
 * Run one of the statements above under snapshot (registered by the caller)
 * rather than a new one, as SPI_execute_snapshot does; returns
 * SPI_processed.
 */
uint64
outbox_sql_run_snapshot(OutboxStatement statement, Datum *values, const char *nulls,
						Snapshot snapshot)
{
	SPIPlanPtr	plan = outbox_plan(statement);
	const StatementDef *def = &statements[statement];
	int			guc_nest_level = idem_plan_settings_begin(def->plan, def->walk_in_order);
	int			ret;

	ret = SPI_execute_snapshot(plan, values, nulls, snapshot,
							   InvalidSnapshot, false, true, 0);
	idem_plan_settings_end(guc_nest_level);
	if (ret < 0)
		elog(ERROR, "outbox statement %d failed: %s",
			 (int) statement, SPI_result_code_string(ret));
	return SPI_processed;
}

/*
 * The routes, from the nrows rows of STMT_ROUTES in SPI_tuptable, into
 * *routes, allocated in the current memory context: "*" apart, the other
 * topics in the order read.
 */
void
outbox_routes_read(uint64 nrows, OutboxRoutes *routes)
{
	routes->default_routed = false;
	routes->nroutes = 0;
	routes->routes = palloc(sizeof(OutboxRoute) * Max(nrows, 1));
	for (uint64 i = 0; i < nrows; i++)
	{
		bool		isnull;
		char	   *topic = TextDatumGetCString(SPI_getbinval(SPI_tuptable->vals[i],
															  SPI_tuptable->tupdesc, 1, &isnull));
		bool		routed = DatumGetBool(SPI_getbinval(SPI_tuptable->vals[i],
														SPI_tuptable->tupdesc, 2, &isnull));

		if (strcmp(topic, "*") == 0)
			routes->default_routed = routed;
		else
		{
			routes->routes[routes->nroutes].topic = topic;
			routes->routes[routes->nroutes++].routed = routed;
		}
	}
}

/*
 * Delete up to limit published rows older than idempotency.outbox_retention
 * (of each of this node's shards of a distributed outbox), and of those
 * whose NOTIFY went out truncated, older than
 * idempotency.notify_truncated_retention too: their listeners read them by
 * id (see STMT_PURGE_PUBLISHED).  Returns how many were; limit or more
 * means there may be more.
 *
 * With outbox_retention = 0 (the default), publishing and acknowledgements
 * delete the rows themselves, and the published rows left are the ones kept
 * for their truncated NOTIFY: so the purge looks only at the rows past that
 * window, all of which go, rather than read past every row still in it at
 * each batch.  A row kept while outbox_retention was longer goes then too.
 */
uint64
outbox_purge_published(TimestampTz now, int limit)
{
	OutboxSqlContext context;
	Datum		values[3];
	uint64		deleted = 0;
	List	   *shards = list_make1_oid(InvalidOid);
	ListCell   *lc;
	TimestampTz truncated_before = TimestampTzPlusMilliseconds(now,
															   -(int64) idem_notify_truncated_retention_s * 1000);

	if (idem_table_distributed(IDEM_TABLE_OUTBOX))
		shards = idem_table_parts(IDEM_TABLE_OUTBOX);
	values[0] = TimestampTzGetDatum(idem_outbox_retention_s == 0 ? truncated_before :
									TimestampTzPlusMilliseconds(now,
																-(int64) idem_outbox_retention_s * 1000));
	values[1] = Int32GetDatum(limit);
	values[2] = TimestampTzGetDatum(truncated_before);
	foreach(lc, shards)
	{
		if (!outbox_sql_begin_on(&context, lfirst_oid(lc)))
			continue;			/* the shard moved away */
		deleted += outbox_sql_run(STMT_PURGE_PUBLISHED, values, NULL);
		outbox_sql_end(&context);
	}
	return deleted;
}
