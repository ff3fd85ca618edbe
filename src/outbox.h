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

extern uint64 outbox_publish_batch(TimestampTz now, int limit, bool careful,
								   uint64 *published, uint64 *failed);
extern uint64 outbox_purge_published(TimestampTz now, int limit);

#endif							/* IDEMPOTENCY_OUTBOX_H */
