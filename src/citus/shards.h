/*-------------------------------------------------------------------------
 *
 * shards.h
 *	  The cluster, as the rest of the extension sees it: how a table is
 *	  distributed, the shard that holds a distribution value and whether
 *	  this node holds it, the shards on this node, this node's group.
 *
 * Only citus/ knows which extension distributes the tables (Citus); this
 * header speaks of distributed tables, shards and nodes.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_SHARDS_H
#define IDEMPOTENCY_SHARDS_H

#include "nodes/pg_list.h"
#include "utils/relcache.h"

/* How the cluster distributes a table */
typedef enum IdemDistribution
{
	IDEM_DIST_LOCAL = 0,		/* not at all: an ordinary table on this node */
	IDEM_DIST_HASH,				/* by hash of a column: its rows are in shards */
	IDEM_DIST_OTHER				/* any other way (replicated, range, ...) */
} IdemDistribution;

extern IdemDistribution idem_table_distribution(Oid relid);
extern const char *idem_distribution_column(Relation rel);
extern Oid	idem_shard_for_value(Relation shell, text *value,
								 const char *function_name);
extern void idem_lock_shard_for_call(Relation shell, text *value,
									 const char *function_name);
extern List *idem_local_shards(Oid shell);
extern bool idem_lock_local_shard(Oid relid);
extern int32 idem_node_group(void);
extern bool idem_function_delegated(Oid funcid);
extern bool idem_cluster_metadata_exists(void);

#endif							/* IDEMPOTENCY_SHARDS_H */
