/*-------------------------------------------------------------------------
 *
 * outbox_sql.h
 *	  The outbox's SQL statements, and the context they run in.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_OUTBOX_SQL_H
#define IDEMPOTENCY_OUTBOX_SQL_H

#include "executor/spi.h"

#include "infra/run_as.h"

typedef enum OutboxStatement
{
	STMT_FETCH_SCAN,
	STMT_FETCH_HEADS,
	STMT_FETCH_FOLLOWERS,
	STMT_FETCH_LEASE,
	STMT_ACK_CHECK,
	STMT_ACK_FENCED_CHECK,
	STMT_ACK_CHECKED_DELETE,
	STMT_ACK_CHECKED_KEEP,
	STMT_ACK_CHECKED_FENCED_DELETE,
	STMT_ACK_CHECKED_FENCED_KEEP,
	STMT_ACK_HOLD,
	STMT_ACK_FENCED_HOLD,
	STMT_NACK,
	STMT_NACK_FENCED,
	STMT_REQUEUE,
	STMT_DISCARD,
	STMT_ROUTE,
	STMT_PUBLISH_CANDIDATES_TOPIC,
	STMT_PUBLISH_CANDIDATES_EXCEPT,
	STMT_PUBLISH_CANDIDATE_ROW,
	STMT_PUBLISH_OLDEST,
	STMT_PUBLISH_OLDEST_EXCEPT,
	STMT_PUBLISH_NEXT_EXCEPT,
	STMT_ROUTES,
	STMT_MARK_PUBLISHED_DELETE,
	STMT_MARK_PUBLISHED_KEEP,
	STMT_MARK_PUBLISHED_TRUNCATED,
	STMT_PUBLISH_FAILED,
	STMT_PURGE_PUBLISHED,
	STMT_ENQUEUE,
	STMT_ENQUEUE_BATCH,
	NUM_STATEMENTS
} OutboxStatement;

/*
 * The schema of the outbox's database: 1.2 has the failures column; a
 * database not updated yet is served 1.1's statements (outbox_sql.c).
 */
typedef enum OutboxSchema
{
	OUTBOX_SCHEMA_1_1,
	OUTBOX_SCHEMA_1_2,
	NUM_OUTBOX_SCHEMAS
} OutboxSchema;

/* The parameters of STMT_FETCH_* (see there), and its columns. */
enum
{
	FETCH_TOPIC,
	FETCH_LIMIT,
	FETCH_LEASE,
	FETCH_NOW,
	FETCH_MAX_ATTEMPTS,
	FETCH_KEY,
	FETCH_AFTER_ID,
	FETCH_IDS,
	FETCH_NPARAMS
};

enum
{
	SCAN_ID = 1,
	SCAN_KEY,
	SCAN_READY
};

enum
{
	HEAD_ID = 1,
	HEAD_KEY,
	HEAD_EXHAUSTED
};

enum
{
	FOLLOWER_ID = 1,
	FOLLOWER_READY
};

/* Columns of STMT_ACK_CHECK */
enum
{
	ACK_CHECK_ID = 1,
	ACK_CHECK_TOPIC,
	ACK_CHECK_KEY
};

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

/* What outbox_sql_begin changed, for outbox_sql_end to restore. */
typedef struct OutboxSqlContext
{
	IdemRunAs	run_as;
} OutboxSqlContext;

extern void outbox_sql_begin(OutboxSqlContext *context);
extern bool outbox_sql_begin_on(OutboxSqlContext *context, Oid shard);
extern void outbox_sql_end(OutboxSqlContext *context);
extern SPIPlanPtr outbox_plan(OutboxStatement statement);
extern uint64 outbox_sql_run(OutboxStatement statement, Datum *values,
							 const char *nulls);
extern Portal outbox_sql_cursor_open(OutboxStatement statement, Datum *values,
									 const char *nulls);
extern uint64 outbox_sql_run_snapshot(OutboxStatement statement, Datum *values,
									 const char *nulls, Snapshot snapshot);

/* A row of outbox_routes, as enqueuers and the publisher see it. */
typedef struct OutboxRoute
{
	char	   *topic;
	bool		routed;			/* somewhere other than none */
} OutboxRoute;

typedef struct OutboxRoutes
{
	bool		default_routed; /* "*" is routed somewhere other than none */
	int			nroutes;
	OutboxRoute *routes;		/* the other topics */
} OutboxRoutes;

extern void outbox_routes_read(uint64 nrows, OutboxRoutes *routes);
extern uint64 outbox_purge_published(TimestampTz now, int limit);

#endif							/* IDEMPOTENCY_OUTBOX_SQL_H */
