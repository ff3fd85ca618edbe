/*-------------------------------------------------------------------------
 *
 * outbox.h
 *	  The transactional outbox, and the context its SQL runs in.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_OUTBOX_H
#define IDEMPOTENCY_OUTBOX_H

#include "datatype/timestamp.h"

/* What outbox_sql_begin changed, for outbox_sql_end to restore. */
typedef struct OutboxSqlContext
{
	Oid			saved_userid;
	int			saved_sec_context;
	int			guc_nest_level;
} OutboxSqlContext;

extern void outbox_sql_begin(OutboxSqlContext *context);
extern void outbox_sql_end(OutboxSqlContext *context);

/* Row ids, kept in context (which outlives a transaction) between batches. */
typedef struct OutboxRowIds
{
	int64	   *ids;
	uint64		count;
	uint64		capacity;
	MemoryContext context;
} OutboxRowIds;

extern uint64 outbox_publish_batch(TimestampTz now, int limit, bool careful,
								   uint64 *published, uint64 *failed,
								   OutboxRowIds *tried);
extern bool outbox_publish_row(TimestampTz now, int64 id, volatile bool *started,
							   uint64 *published, uint64 *failed);
extern bool outbox_record_failure(TimestampTz now, int64 id, const char *error);
extern bool outbox_error_counts_against_row(const ErrorData *error);
extern uint64 outbox_purge_published(TimestampTz now, int limit);

#endif							/* IDEMPOTENCY_OUTBOX_H */
