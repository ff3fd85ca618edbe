/*-------------------------------------------------------------------------
 *
 * shards.h
 *	  Where a row of a table that Citus distributes lives: the shard that
 *	  holds a distribution value, and whether this node holds it.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_SHARDS_H
#define IDEMPOTENCY_SHARDS_H

#include "nodes/pg_list.h"
#include "utils/relcache.h"

/* pg_dist_partition.partmethod of a hash-distributed table */
#define IDEM_CITUS_HASH 'h'

extern char idem_citus_partmethod(Oid relid);
extern AttrNumber idem_citus_distribution_column(Oid relid);
extern Oid	idem_shard_for_value(Relation shell, text *value,
								 const char *function_name);
extern void idem_lock_shard_for_call(Relation shell, text *value,
									 const char *function_name);
extern List *idem_local_shards(Oid shell);
extern bool idem_lock_local_shard(Oid relid);
extern int32 idem_citus_local_group(void);
extern bool idem_citus_delegates_function(Oid funcid);

#endif							/* IDEMPOTENCY_SHARDS_H */
