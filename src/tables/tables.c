/*-------------------------------------------------------------------------
 *
 * tables.c
 *	  Finding and writing rows of the extension's tables without the
 *	  executor.
 *
 * The hot paths (idem_claim and friends) need two things SQL cannot give
 * them: to see a row that another transaction is inserting right now without
 * waiting for that transaction to end, and to give up a write instead of
 * waiting for a concurrent one.  INSERT ... ON CONFLICT and UPDATE both wait.
 * So the rows are found with an index probe under a dirty snapshot, which
 * reports in-flight inserters and modifiers instead of blocking on them, and
 * written with the table AM directly: a new row by speculative insertion (the
 * mechanism behind ON CONFLICT, used here without its waits), an existing one
 * by table_tuple_update/delete with wait = false where the caller must not
 * block.
 *
 * Skipping the executor also skips the planner, SPI and per-call catalog
 * lookups: a lookup is one index probe.  What the executor would otherwise
 * do for us is done here: index entries for new row versions, and a
 * CommandCounterIncrement after each write so that the next call in the same
 * statement sees it.  Triggers on these tables do not fire; the tables
 * belong to the extension.
 *
 * Owns: the tables' OIDs (cached per backend), the probe, speculative
 *	  insertion, updates and deletes that give up instead of waiting, index
 *	  maintenance.
 * May call: tables/table_check.h (on first open), infra/subxact.h (the
 *	  outbox sequence's move), compat.h.  Called by
 *	  keys/keys.c, events/events.c (the batch mark; the owner for the rest),
 *	  outbox/outbox.c (the shard and the ids of an enqueue),
 *	  outbox/outbox_sql.c (the owner), outbox/outbox_ack.c (the outbox) and
 *	  worker/purge.c (the walk).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/relation.h"
#include "access/table.h"
#include "access/xact.h"
#include "catalog/index.h"
#include "access/htup_details.h"
#include "catalog/namespace.h"
#include "nodes/makefuncs.h"
#include "catalog/pg_collation.h"
#include "catalog/pg_index.h"
#include "catalog/pg_type.h"
#include "commands/sequence.h"
#include "executor/executor.h"
#include "executor/tuptable.h"
#include "miscadmin.h"
#include "storage/lmgr.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"

#include "compat.h"
#include "tables/table_check.h"
#include "citus/shards.h"
#include "tables/tables.h"
#include "infra/subxact.h"

#define IDEM_SCHEMA "idempotency"

/*
 * The tables as the script creates them (see table_check.h): if someone
 * alters one, idem_check_table refuses to read or write it rather than
 * misread its rows or skip a rule that SQL on the same table would enforce.
 */
static const ExpectedColumn keys_columns[Natts_keys] = {
	{"scope", TEXTOID, true, true},
	{"key", TEXTOID, true, true},
	{"fingerprint", TEXTOID, false, false},
	{"attempt", INT4OID, true, false},
	{"recovery_point", TEXTOID, false, false},
	{"lease_expires_at", TIMESTAMPTZOID, false, false},
	{"status_code", INT4OID, false, false},
	{"body", TEXTOID, false, false},
	{"headers", JSONBOID, false, false},
	{"ttl", INTERVALOID, true, false},
	{"created_at", TIMESTAMPTZOID, true, false},
	{"completed_at", TIMESTAMPTZOID, false, false},
	{"expires_at", TIMESTAMPTZOID, true, false},
};

static const char *const keys_checks[] = {"keys_status_code_check", NULL};

/* both tables' primary keys are their first two columns, both text */
static const AttrNumber first_two_columns[] = {1, 2};
static const Oid two_text_columns_eq[] = {F_TEXTEQ, F_TEXTEQ};

static const ExpectedColumn events_columns[Natts_events] = {
	{"consumer", TEXTOID, true, true},
	{"event_id", TEXTOID, true, true},
	{"processed_at", TIMESTAMPTZOID, true, false},
	{"expires_at", TIMESTAMPTZOID, true, false},
};

static const char *const no_checks[] = {NULL};

static const ExpectedColumn outbox_columns[Natts_outbox] = {
	{"id", INT8OID, true, false},
	{"topic", TEXTOID, true, true},
	{"key", TEXTOID, false, true},
	{"payload", JSONBOID, true, false},
	{"headers", JSONBOID, false, false},
	{"created_at", TIMESTAMPTZOID, true, false},
	{"state", TEXTOID, true, false},
	{"attempts", INT4OID, true, false},
	{"available_at", TIMESTAMPTZOID, true, false},
	{"last_error", TEXTOID, false, false},
	{"published_at", TIMESTAMPTZOID, false, false},
	/* from 1.2 on: absent in a database still at 1.1 */
	{"failures", INT4OID, true, false},
};

static const char *const outbox_checks[] = {"outbox_state_check", NULL};

/*
 * The outbox's primary key holds the topic, as Citus wants of a unique index
 * of a table distributed by it: (id, topic) from 1.2, so that it finds a row
 * by id too (1.1's was (topic, id), beside an index on id alone).  It is
 * never probed: enqueued ids come from the sequence.
 */
static const AttrNumber id_and_topic[] = {Anum_outbox_id, Anum_outbox_topic};
static const Oid id_and_topic_eq[] = {F_INT8EQ, F_TEXTEQ};
static const AttrNumber topic_and_id[] = {Anum_outbox_topic, Anum_outbox_id};

static const ExpectedTable table_defs[IDEM_NUM_TABLES] = {
	[IDEM_TABLE_KEYS] = {"keys", Natts_keys, keys_columns,
	2, first_two_columns, two_text_columns_eq, keys_checks, Anum_keys_expires_at, 0},
	[IDEM_TABLE_EVENTS] = {"processed_events", Natts_events, events_columns,
	2, first_two_columns, two_text_columns_eq, no_checks, Anum_events_expires_at, 0},
	/* the outbox's life is SQL (outbox_sql.c), but for the ack's order check */
	[IDEM_TABLE_OUTBOX] = {"outbox", Natts_outbox, outbox_columns,
	2, id_and_topic, id_and_topic_eq, outbox_checks, InvalidAttrNumber,
	Natts_outbox - Natts_outbox_1_1, topic_and_id},
};

#define OUTBOX_SEQUENCE "outbox_id_seq"

/*
 * The OIDs of our tables, once found by name and checked for shape.
 * Forgotten when the relcache says the table changed (ALTER, DROP
 * EXTENSION, a cache reset), so that the next open looks it up again.
 */
static Oid	cached_relid[IDEM_NUM_TABLES];
/* and how the cluster distributes each (citus/shards.h) */
static IdemDistribution cached_distribution[IDEM_NUM_TABLES];

/*
 * The shards of distributed tables that idem_check_table has passed since
 * they were last invalidated (a shard is a table of its own, with a
 * relcache entry of its own); past the array's end, a shard is checked at
 * every open.
 */
#define MAX_CHECKED_SHARDS 64
static Oid	checked_shards[MAX_CHECKED_SHARDS];
static Oid	cached_sequence = InvalidOid;	/* outbox ids, see idem_outbox_next_id */

/* Where the outbox is distributed, the low bits of an id that hold the node's group */
#define NODE_GROUP_BITS 16

/*
 * The row version this transaction wrote last, so that the next call about
 * the same key in the same transaction (idem_complete after idem_claim) finds
 * it without a second descent of the primary key: see probe_own_row.
 */
typedef struct OwnRow
{
	Oid			relid;
	TransactionId xid;			/* the top-level transaction that wrote it */
	ItemPointerData tid;
} OwnRow;

static OwnRow own_row;
static bool invalidation_registered = false;

/*
 * The table idem_check_table is looking at, and whether an invalidation of
 * it (or a cache reset) came while it looked: see check_table.
 */
static Oid	relid_in_check = InvalidOid;
static bool check_overtaken = false;

static void
forget_cached_table(Datum arg, Oid relid)
{
	if (relid == InvalidOid || relid == cached_sequence ||
		relid == cached_relid[IDEM_TABLE_OUTBOX])
		cached_sequence = InvalidOid;
	/* TRUNCATE, CLUSTER and the like move rows: forget where ours was */
	if (relid == InvalidOid || relid == own_row.relid)
		own_row.relid = InvalidOid;
	for (int i = 0; i < IDEM_NUM_TABLES; i++)
		if (relid == InvalidOid || relid == cached_relid[i])
			cached_relid[i] = InvalidOid;
	for (int i = 0; i < MAX_CHECKED_SHARDS; i++)
		if (relid == InvalidOid || relid == checked_shards[i])
			checked_shards[i] = InvalidOid;
	if (relid == InvalidOid || relid == relid_in_check)
		check_overtaken = true;
}

/*
 * Check the table (table_check.c), and say whether its answer may be kept
 * until the next invalidation of the table: not when one came while the
 * check ran.  The check's catalog reads take in the invalidations queued
 * meanwhile; one of them may be a change committed under a lock weaker
 * than the DDL guards against (a trigger created while we hold
 * AccessShareLock), taken in after the check looked at that part.  Were
 * the OID kept, its invalidation would be spent and the next writer would
 * never look again; unkept, the next open checks the table as it is.
 */
static bool
check_table(Relation heap, const ExpectedTable *def)
{
	relid_in_check = RelationGetRelid(heap);
	check_overtaken = false;
	idem_check_table(heap, def);
	relid_in_check = InvalidOid;
	return !check_overtaken;
}

/*
 * Open one of our tables, locked until the end of the transaction: the
 * table itself, or the shell of one that Citus hash-distributes (*distribution
 * says which: see idem_relation_open for its rows).
 *
 * The OID found last time is locked first: taking the lock processes any
 * invalidation that arrived meanwhile, so if the table was dropped or
 * altered, the relcache callback has forgotten the OID by the time the lock
 * is ours, and we let the lock go and look the name up again.  Looking up
 * by name is RangeVarGetRelid's job, which locks and looks again itself
 * until the two agree.
 */
/*
 * A hash-distributed table must be distributed by the column the functions
 * find its shard by (its first key column: scope, consumer, topic), as
 * idem_distribute() does it; otherwise the functions and Citus would each
 * put a row in another shard.
 */
static void
check_distribution_column(Relation heap, IdemTable table)
{
	static const char *const expected[IDEM_NUM_TABLES] = {
		[IDEM_TABLE_KEYS] = "scope",
		[IDEM_TABLE_EVENTS] = "consumer",
		[IDEM_TABLE_OUTBOX] = "topic",
	};
	const char *actual = idem_distribution_column(heap);

	if (strcmp(actual, expected[table]) != 0)
		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("table \"%s.%s\" is distributed by column \"%s\", not by \"%s\"",
						IDEM_SCHEMA, RelationGetRelationName(heap),
						actual, expected[table]),
				 errdetail("The functions find a row's shard by its \"%s\"; the cluster would look for it in another shard.",
						   expected[table]),
				 errhint("Undistribute it (undistribute_table) and run idempotency.idem_distribute().")));
}

static Relation
open_table(IdemTable table, LOCKMODE lockmode, IdemDistribution *distribution)
{
	const ExpectedTable *def = &table_defs[table];
	Oid			relid = cached_relid[table];
	Relation	heap;

	if (!invalidation_registered)
	{
		CacheRegisterRelcacheCallback(forget_cached_table, (Datum) 0);
		invalidation_registered = true;
	}

	if (OidIsValid(relid))
	{
		LockRelationOid(relid, lockmode);
		if (cached_relid[table] == relid)
		{
			*distribution = cached_distribution[table];
			return table_open(relid, NoLock);
		}
		UnlockRelationOid(relid, lockmode);
	}

	relid = RangeVarGetRelid(makeRangeVar(IDEM_SCHEMA, (char *) def->name, -1),
							 lockmode, true);
	if (!OidIsValid(relid))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_TABLE),
				 errmsg("table \"%s.%s\" does not exist", IDEM_SCHEMA, def->name),
				 errhint("Run CREATE EXTENSION idempotency in this database.")));
	heap = table_open(relid, NoLock);
	/*
	 * A table that Citus hash-distributes is a shell here: its shards are
	 * checked instead, when they are opened (open_shard).  Any other kind
	 * of Citus table is refused by the check.
	 */
	*distribution = idem_table_distribution(relid);
	if (*distribution != IDEM_DIST_HASH)
	{
		if (!check_table(heap, def))
			return heap;
	}
	else
		check_distribution_column(heap, table);
	cached_distribution[table] = *distribution;
	cached_relid[table] = relid;
	return heap;
}

/*
 * The shard of a distributed table that holds value, opened and locked
 * (shards.c finds it, or refuses), and checked as the table itself would
 * be the first time.
 */
static Relation
open_shard(IdemTable table, Relation shell, text *value, LOCKMODE lockmode,
		   const char *function_name)
{
	Oid			relid = idem_shard_for_value(shell, value, function_name);
	Relation	shard = table_open(relid, lockmode);
	int			free_slot = -1;

	for (int i = 0; i < MAX_CHECKED_SHARDS; i++)
	{
		if (checked_shards[i] == relid)
			return shard;
		if (free_slot < 0 && !OidIsValid(checked_shards[i]))
			free_slot = i;
	}
	if (check_table(shard, &table_defs[table]) && free_slot >= 0)
		checked_shards[free_slot] = relid;
	return shard;
}

/* What the C code expects of the table (table_check.h). */
const ExpectedTable *
idem_table_def(IdemTable table)
{
	return &table_defs[table];
}

/*
 * The role that owns the outbox, which the outbox's SQL runs as (outbox_sql.c),
 * once idem_check_table has seen that the table is the one those statements
 * and their callers were built for.  Only the outbox is locked here: the
 * worker publishes holding its lock, and DROP EXTENSION locks the tables in
 * an order of its own, so a lock on another of them taken now could
 * deadlock with it.  *natts is set to how many columns it has: Natts_outbox,
 * or, in a database still at 1.1, Natts_outbox_1_1.
 */
Oid
idem_outbox_owner(int *natts)
{
	IdemDistribution distribution;
	Relation	heap = open_table(IDEM_TABLE_OUTBOX, AccessShareLock, &distribution);
	Oid			owner = heap->rd_rel->relowner;

	*natts = RelationGetDescr(heap)->natts;

	table_close(heap, NoLock);
	return owner;
}

/*
 * For the statements that reach one of our tables through SPI: the role
 * that owns it (they run as that role, see infra/run_as.c), and in *shard
 * where the rows whose distribution value is value are: InvalidOid for the
 * table itself, or, where Citus distributes it, the shard that holds value
 * on this node (an ERROR naming function_name otherwise).  Locked in
 * lockmode until the end of the transaction.
 */
Oid
idem_table_owner(IdemTable table, text *value, LOCKMODE lockmode,
				 const char *function_name, Oid *shard)
{
	IdemDistribution distribution;
	Relation	heap = open_table(table, lockmode, &distribution);
	Oid			owner = heap->rd_rel->relowner;

	*shard = InvalidOid;
	if (distribution == IDEM_DIST_HASH)
	{
		Relation	rel = open_shard(table, heap, value, lockmode, function_name);

		*shard = RelationGetRelid(rel);
		table_close(rel, NoLock);
	}
	table_close(heap, NoLock);
	return owner;
}

/*
 * The outbox, locked in lockmode until the end of the transaction, once
 * idem_check_table has seen that it is the one expected: for the reading of
 * its indexes by the ack's order check (outbox_ack.c).  Not for a table
 * that Citus distributes, whose shards the ack checks by SQL.
 */
Relation
idem_outbox_open(LOCKMODE lockmode)
{
	IdemDistribution distribution;

	return open_table(IDEM_TABLE_OUTBOX, lockmode, &distribution);
}

/*
 * The relations that hold the table's rows on this node, as OIDs: the
 * table itself, or, where Citus distributes it, its shards placed here
 * (none on a coordinator).  For the purge's walk.
 */
List *
idem_table_parts(IdemTable table)
{
	IdemDistribution distribution;
	Relation	heap = open_table(table, AccessShareLock, &distribution);
	List	   *parts;

	if (distribution == IDEM_DIST_HASH)
		parts = idem_local_shards(RelationGetRelid(heap));
	else
		parts = list_make1_oid(RelationGetRelid(heap));
	table_close(heap, NoLock);
	return parts;
}

/*
 * Open one of the table's parts (idem_table_parts), a shard checked as
 * open_shard checks it; NULL if it is gone meanwhile (a shard moved away
 * and dropped).
 */
Relation
idem_table_part_open(IdemTable table, Oid relid, LOCKMODE lockmode)
{
	Relation	heap;
	IdemDistribution distribution;

	heap = open_table(table, lockmode, &distribution);
	if (RelationGetRelid(heap) == relid)
		return heap;
	table_close(heap, NoLock);
	heap = try_table_open(relid, lockmode);
	if (heap == NULL)
		return NULL;
	for (int i = 0; i < MAX_CHECKED_SHARDS; i++)
		if (checked_shards[i] == relid)
			return heap;
	check_table(heap, &table_defs[table]);
	return heap;
}

/*
 * Where a statement of the outbox's SQL (outbox_sql.c) is to run for the
 * distribution value value: InvalidOid for the table itself, or, where Citus
 * distributes it, the shard that holds value on this node, locked and
 * checked (an ERROR naming function_name and how to call it otherwise).
 */
Oid
idem_table_shard_for(IdemTable table, text *value, LOCKMODE lockmode,
					 const char *function_name)
{
	IdemDistribution distribution;
	Relation	heap = open_table(table, lockmode, &distribution);
	Oid			shard = InvalidOid;

	if (distribution == IDEM_DIST_HASH)
	{
		Relation	rel = open_shard(table, heap, value, lockmode, function_name);

		shard = RelationGetRelid(rel);
		table_close(rel, NoLock);
	}
	table_close(heap, NoLock);
	return shard;
}

/*
 * Whether Citus hash-distributes the table, whose rows are then in shards
 * that only the functions with a distribution value reach (see
 * idem_relation_open), not the outbox's SQL.
 */
bool
idem_table_distributed(IdemTable table)
{
	IdemDistribution distribution;
	Relation	heap = open_table(table, AccessShareLock, &distribution);

	table_close(heap, NoLock);
	return distribution == IDEM_DIST_HASH;
}

/*
 * Open one of our tables for reading or writing the rows whose
 * distribution column (its primary key's first: scope, consumer, topic)
 * is value: the table itself, or, where Citus distributes it, the shard
 * holding value if this node has it (an ERROR naming function_name and how
 * to call it otherwise).
 */
void
idem_relation_open(IdemRelation *rel, IdemTable table, LOCKMODE lockmode,
				   text *value, const char *function_name)
{
	IdemDistribution distribution;

	memset(rel, 0, sizeof(IdemRelation));
	rel->table = table;
	rel->lockmode = lockmode;
	rel->mcxt = CurrentMemoryContext;
	rel->heap = open_table(table, lockmode, &distribution);
	if (distribution == IDEM_DIST_HASH)
	{
		Relation	shell = rel->heap;

		rel->heap = open_shard(table, shell, value, lockmode, function_name);
		table_close(shell, NoLock);
	}
	/*
	 * idem_check_table made sure there is one, and the one expected; not
	 * rd_pkindex itself, unset in an entry rebuilt since (table_check.c)
	 */
	rel->pkey = index_open(idem_primary_key_index(rel->heap), lockmode);
}

/*
 * Open every index of the table, for the writes that must add index entries.
 * Column indexes, partial or not, are maintained here; an index on an
 * expression, an exclusion constraint or a second unique index is refused by
 * name.
 */
static void
open_all_indexes(IdemRelation *rel)
{
	List	   *index_oids;
	ListCell   *lc;
	int			i = 0;
	MemoryContext oldcontext;

	if (rel->indexes != NULL)
		return;

	oldcontext = MemoryContextSwitchTo(rel->mcxt);
	index_oids = RelationGetIndexList(rel->heap);
	rel->indexes = palloc(sizeof(Relation) * Max(list_length(index_oids), 1));
	rel->index_info = palloc(sizeof(IndexInfo *) * Max(list_length(index_oids), 1));
	foreach(lc, index_oids)
	{
		Relation	index = index_open(lfirst_oid(lc), rel->lockmode);
		IndexInfo  *info = BuildIndexInfo(index);

		rel->indexes[i] = index;
		rel->index_info[i] = info;
		rel->nindexes = ++i;

		if (info->ii_Expressions != NIL || info->ii_ExclusionOps != NULL ||
			(info->ii_Unique && RelationGetRelid(index) != RelationGetRelid(rel->pkey)))
			ereport(ERROR,
					(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
					 errmsg("index \"%s\" on table \"%s.%s\" is not supported",
							RelationGetRelationName(index), IDEM_SCHEMA,
							table_defs[rel->table].name),
					 errdetail("The extension maintains its tables' indexes itself and handles only non-unique column indexes, with or without a WHERE clause, besides the primary key."),
					 errhint("Drop the index.")));
	}
	list_free(index_oids);
	MemoryContextSwitchTo(oldcontext);
}

void
idem_relation_close(IdemRelation *rel)
{
	Assert(!rel->in_batch);
	if (rel->batch_slot != NULL)
		ExecDropSingleTupleTableSlot(rel->batch_slot);
	if (rel->estate != NULL)
		FreeExecutorState(rel->estate);
	/* the locks are kept until the end of the transaction, as the executor does */
	for (int i = 0; i < rel->nindexes; i++)
		index_close(rel->indexes[i], NoLock);
	index_close(rel->pkey, NoLock);
	table_close(rel->heap, NoLock);
}

static void
remember_own_row(IdemRelation *rel, ItemPointer tid)
{
	own_row.relid = RelationGetRelid(rel->heap);
	own_row.xid = GetTopTransactionId();
	own_row.tid = *tid;
}

/* Is this text datum, which came from a row, the same bytes as that one? */
static bool
same_text(Datum stored, Datum wanted)
{
	struct varlena *a = (struct varlena *) DatumGetPointer(stored);
	struct varlena *b = (struct varlena *) DatumGetPointer(wanted);

	if (VARATT_IS_EXTERNAL(a) || VARATT_IS_COMPRESSED(a))
		return false;			/* toasted or compressed: let the probe decide */
	return VARSIZE_ANY_EXHDR(a) == VARSIZE_ANY_EXHDR(b) &&
		memcmp(VARDATA_ANY(a), VARDATA_ANY(b), VARSIZE_ANY_EXHDR(a)) == 0;
}

/*
 * The row this transaction wrote last, if it is the current version of the
 * key asked for.  It is, when the version at the remembered place was
 * written by this transaction (not by an aborted subtransaction), has not
 * been updated, deleted or locked since (xmax unset), and holds that key:
 * no other transaction can have touched an uncommitted row of ours, and the
 * primary key allows no other live version.  Anything less, and the caller
 * probes the index as usual.
 */
static bool
probe_own_row(IdemRelation *rel, const Datum *pkey_values, ProbeResult *result)
{
	const ExpectedTable *def = &table_defs[rel->table];
	TupleTableSlot *slot;
	HeapTuple	tuple;
	bool		found = false;

	if (def->pkey_eq != two_text_columns_eq ||
		own_row.relid != RelationGetRelid(rel->heap) ||
		own_row.xid != GetTopTransactionIdIfAny() ||
		!TransactionIdIsValid(own_row.xid))
		return false;

	slot = table_slot_create(rel->heap, NULL);
	if (table_tuple_fetch_row_version(rel->heap, &own_row.tid, SnapshotAny, slot))
	{
		tuple = ExecFetchSlotHeapTuple(slot, false, NULL);
		found = (tuple->t_data->t_infomask & HEAP_XMAX_INVALID) != 0 &&
			TransactionIdIsCurrentTransactionId(HeapTupleHeaderGetXmin(tuple->t_data));
		for (int i = 0; found && i < def->npkey; i++)
		{
			bool		isnull;
			Datum		value = slot_getattr(slot, i + 1, &isnull);

			found = !isnull && same_text(value, pkey_values[i]);
		}
	}
	if (found)
	{
		memset(result, 0, sizeof(ProbeResult));
		result->outcome = PROBE_FOUND;
		result->tuple = ExecCopySlotHeapTuple(slot);
		result->tid = own_row.tid;
		result->written_by_us = true;
	}
	ExecDropSingleTupleTableSlot(slot);
	return found;
}

/*
 * Look a primary key up under a dirty snapshot.  The dirty snapshot sees
 * committed rows, this transaction's rows, and rows that other transactions
 * are inserting or modifying right now, and says which (xmin / xmax) instead
 * of waiting.  A non-MVCC index scan returns every such version of the row:
 * at most one is settled (committed or ours); others are in flight.
 */
void
idem_probe(IdemRelation *rel, const Datum *pkey_values, ProbeResult *result)
{
	const ExpectedTable *def = &table_defs[rel->table];
	SnapshotData dirty;
	ScanKeyData scankeys[INDEX_MAX_KEYS];
	IndexScanDesc scan;
	TupleTableSlot *slot;

	if (probe_own_row(rel, pkey_values, result))
		return;

	memset(result, 0, sizeof(ProbeResult));
	result->outcome = PROBE_ABSENT;

	for (int i = 0; i < def->npkey; i++)
		ScanKeyEntryInitialize(&scankeys[i], 0, i + 1, BTEqualStrategyNumber,
							   InvalidOid, rel->pkey->rd_indcollation[i],
							   def->pkey_eq[i], pkey_values[i]);

	InitDirtySnapshot(dirty);
	slot = table_slot_create(rel->heap, NULL);
	scan = compat_index_beginscan(rel->heap, rel->pkey, &dirty, def->npkey, 0);
	index_rescan(scan, scankeys, def->npkey, NULL, 0);

	while (index_getnext_slot(scan, ForwardScanDirection, slot))
	{
		if (TransactionIdIsValid(dirty.xmin))
		{
			/* another transaction is inserting this version */
			result->outcome = PROBE_INSERTING;
			result->inserting_xid = dirty.xmin;
			result->speculative_token = dirty.speculativeToken;
			continue;
		}
		result->outcome = PROBE_FOUND;
		result->tuple = ExecCopySlotHeapTuple(slot);
		result->tid = slot->tts_tid;
		result->being_modified = TransactionIdIsValid(dirty.xmax);
		result->modifying_xid = dirty.xmax;
		result->written_by_us =
			TransactionIdIsCurrentTransactionId(HeapTupleHeaderGetXmin(result->tuple->t_data));
		break;
	}

	index_endscan(scan);
	ExecDropSingleTupleTableSlot(slot);
}

/*
 * Under REPEATABLE READ and SERIALIZABLE, a row may be written only if the
 * transaction's snapshot sees it: this tells whether it does.
 */
bool
idem_row_visible_to_snapshot(IdemRelation *rel, const ProbeResult *found)
{
	TupleTableSlot *slot = table_slot_create(rel->heap, NULL);
	bool		visible;

	Assert(found->outcome == PROBE_FOUND);
	visible = table_tuple_fetch_row_version(rel->heap, (ItemPointer) &found->tid,
											GetTransactionSnapshot(), slot);
	ExecDropSingleTupleTableSlot(slot);
	return visible;
}

static TupleTableSlot *
make_slot(IdemRelation *rel, Datum *values, bool *nulls)
{
	TupleTableSlot *slot = MakeSingleTupleTableSlot(RelationGetDescr(rel->heap),
													&TTSOpsVirtual);

	memcpy(slot->tts_values, values, sizeof(Datum) * slot->tts_tupleDescriptor->natts);
	memcpy(slot->tts_isnull, nulls, sizeof(bool) * slot->tts_tupleDescriptor->natts);
	ExecStoreVirtualTuple(slot);
	return slot;
}

/*
 * Does the row version in slot belong in the i-th index?  Only a partial
 * index can say no; its predicate is prepared on first use, in an executor
 * state kept until the relation is closed.
 */
static bool
index_wants_row(IdemRelation *rel, int i, TupleTableSlot *slot)
{
	List	   *predicate = rel->index_info[i]->ii_Predicate;
	ExprContext *econtext;
	bool		wanted;

	if (predicate == NIL)
		return true;
	if (rel->estate == NULL)
	{
		MemoryContext oldcontext = MemoryContextSwitchTo(rel->mcxt);

		rel->estate = CreateExecutorState();
		rel->predicates = palloc0(sizeof(ExprState *) * rel->nindexes);
		MemoryContextSwitchTo(oldcontext);
	}
	if (rel->predicates[i] == NULL)
		rel->predicates[i] = ExecPrepareQual(predicate, rel->estate);

	econtext = GetPerTupleExprContext(rel->estate);
	econtext->ecxt_scantuple = slot;
	wanted = ExecQual(rel->predicates[i], econtext);
	ResetExprContext(econtext);
	return wanted;
}

/*
 * Add index entries for the row version in slot.  The primary key is checked
 * as the caller says; other unique indexes are checked in full.  Returns
 * false when the primary key check found a possible conflict.
 */
static bool
insert_index_entries(IdemRelation *rel, TupleTableSlot *slot,
					 IndexUniqueCheck pkey_check, bool is_update,
					 CompatUpdateIndexes update_indexes)
{
	bool		pkey_ok = true;

	open_all_indexes(rel);
	for (int i = 0; i < rel->nindexes; i++)
	{
		Relation	index = rel->indexes[i];
		bool		is_pkey = RelationGetRelid(index) == RelationGetRelid(rel->pkey);
		Datum		values[INDEX_MAX_KEYS];
		bool		isnull[INDEX_MAX_KEYS];
		IndexUniqueCheck check;
		bool		ok;

		if (is_update && !COMPAT_UPDATE_NEEDS_INDEX(update_indexes, index))
			continue;
		/* an index being built concurrently is not ready for entries yet */
		if (!rel->index_info[i]->ii_ReadyForInserts)
			continue;
		if (!index_wants_row(rel, i, slot))
			continue;

		check = is_pkey ? pkey_check : UNIQUE_CHECK_NO;

		FormIndexDatum(rel->index_info[i], slot, NULL, values, isnull);
		ok = index_insert(index, values, isnull, &slot->tts_tid, rel->heap,
						  check, is_update && is_pkey, rel->index_info[i]);
		if (is_pkey)
			pkey_ok = ok;
	}
	return pkey_ok;
}

/*
 * A batch of insertions in one call (idem_mark_processed_batch's): until
 * idem_batch_end, idem_insert_unique forms each row's heap tuple into one
 * slot for every row instead of making a slot each (which the heap copied
 * the row out of once more), takes one speculative insertion token for the whole
 * batch instead of one per row (a lock manager round each), and leaves
 * the CommandCounterIncrement to the end, as a multi-row INSERT does: the
 * batch's rows have distinct keys, and the dirty snapshot of a probe sees
 * this transaction's rows whatever their command id.
 *
 * Holding the token longer changes only how long a concurrent inserter of
 * one of the batch's keys that met the row half-inserted waits before it
 * looks again: until the batch ends rather than until that row is
 * confirmed.  It then waits for our transaction, as it would have anyway;
 * the lock manager sees both waits, so a cycle is a deadlock it reports,
 * never a hang.
 */
void
idem_batch_begin(IdemRelation *rel)
{
	Assert(!rel->in_batch);
	rel->in_batch = true;
	rel->batch_token = 0;
	rel->batch_wrote = false;
	if (rel->batch_slot == NULL)
	{
		MemoryContext oldcontext = MemoryContextSwitchTo(rel->mcxt);

		rel->batch_slot = MakeSingleTupleTableSlot(RelationGetDescr(rel->heap),
												   &TTSOpsHeapTuple);
		MemoryContextSwitchTo(oldcontext);
	}
}

void
idem_batch_end(IdemRelation *rel)
{
	Assert(rel->in_batch);
	if (rel->batch_token != 0)
		SpeculativeInsertionLockRelease(rel->batch_xid);
	if (rel->batch_wrote)
		CommandCounterIncrement();
	rel->in_batch = false;
	rel->batch_token = 0;
}

/*
 * Insert a row unless its primary key is taken, without ever waiting.
 *
 * This is speculative insertion, as INSERT ... ON CONFLICT does it: insert
 * the heap tuple marked speculative, insert the index entries with only a
 * partial uniqueness check (which reports a possible duplicate instead of
 * waiting for its transaction), then either confirm the tuple or kill it.
 * A killed speculative tuple is dead to everyone at once, so a lost race
 * leaves nothing behind that others would wait for.  Returns true if the row
 * was inserted; false if another row (committed or in flight) has the key,
 * in which case nothing was written and the caller probes again.  In a
 * batch, see idem_batch_begin.
 */
bool
idem_insert_unique(IdemRelation *rel, Datum *values, bool *nulls)
{
	TupleTableSlot *slot;
	TransactionId xid = GetCurrentTransactionId();
	uint32		token;
	bool		inserted;

	if (rel->in_batch)
	{
		/* formed once, here, and stored by the heap as it is */
		slot = rel->batch_slot;
		ExecStoreHeapTuple(heap_form_tuple(RelationGetDescr(rel->heap), values, nulls),
						   slot, true);
		if (rel->batch_token == 0)
		{
			rel->batch_xid = xid;
			rel->batch_token = SpeculativeInsertionLockAcquire(xid);
		}
		token = rel->batch_token;
	}
	else
	{
		slot = make_slot(rel, values, nulls);
		token = SpeculativeInsertionLockAcquire(xid);
	}

	table_tuple_insert_speculative(rel->heap, slot, GetCurrentCommandId(true),
								   0, NULL, token);
	inserted = insert_index_entries(rel, slot, UNIQUE_CHECK_PARTIAL, false, false);
	table_tuple_complete_speculative(rel->heap, slot, token, inserted);
	if (inserted)
		remember_own_row(rel, &slot->tts_tid);

	if (rel->in_batch)
	{
		ExecClearTuple(slot);
		rel->batch_wrote = true;
		return inserted;
	}
	SpeculativeInsertionLockRelease(xid);
	ExecDropSingleTupleTableSlot(slot);
	CommandCounterIncrement();
	return inserted;
}

/*
 * Move the sequence past target, for idem_outbox_next_id.  setval is not
 * transactional, and safe only while no other transaction can call nextval
 * (it would move the sequence back below values handed out meanwhile):
 * ShareRowExclusiveLock on the sequence waits for the transactions that
 * called nextval to end (nextval holds RowExclusiveLock until then) and
 * keeps others out, another transaction's sequence_past too (with
 * ShareLock, two could hold it at once, and each wait for the other's
 * nextval below).  It is taken in a subtransaction rolled back at once,
 * which releases the lock and keeps the setval.  Returns a value past
 * target.
 *
 * A transaction that called nextval already holds the sequence as those it
 * waits for do: two of them that each wait here for the other deadlock.
 * So idem_outbox_next_id comes here before its nextval where it can.
 */
typedef struct SequenceMove
{
	Oid			seqid;
	int64		target;
	int64		value;			/* the nextval taken under the lock */
} SequenceMove;

/* sequence_past's work, in its subtransaction */
static void
sequence_move_work(void *arg)
{
	SequenceMove *move = arg;

	LockRelationOid(move->seqid, ShareRowExclusiveLock);
	move->value = nextval_internal(move->seqid, false);
	if (move->value <= move->target)
		(void) DirectFunctionCall2(setval_oid, ObjectIdGetDatum(move->seqid),
								   Int64GetDatum(move->target));
}

static int64
sequence_past(Oid seqid, int64 target)
{
	SequenceMove move = {seqid, target, 0};

	(void) idem_subxact_run(sequence_move_work, &move, SUBXACT_ROLL_BACK, NULL);
	return move.value > target ? move.value : nextval_internal(seqid, false);
}

/*
 * The sequence's last value, read as SELECT last_value FROM it reads it,
 * without the lock that nextval takes and keeps until the transaction ends:
 * whether the sequence is behind, before idem_outbox_next_id calls nextval.
 */
static int64
sequence_last_value(Oid seqid)
{
	Relation	seq = relation_open(seqid, AccessShareLock);
	TableScanDesc scan = table_beginscan(seq, GetLatestSnapshot(), 0, NULL);
	TupleTableSlot *slot = table_slot_create(seq, NULL);
	int64		last = PG_INT64_MAX;
	bool		isnull;

	if (table_scan_getnextslot(scan, ForwardScanDirection, slot))
	{
		Datum		value = slot_getattr(slot, 1, &isnull);	/* last_value */

		if (!isnull)
			last = DatumGetInt64(value);
	}
	table_endscan(scan);
	ExecDropSingleTupleTableSlot(slot);
	relation_close(seq, AccessShareLock);
	return last;
}

/*
 * The next outbox id, from the sequence the outbox's id column defaults to,
 * above floor.  The caller has the outbox open, so an invalidation that
 * dropped or replaced the sequence has been processed and the cached OID
 * forgotten.
 *
 * On one node, the sequence's next value, always above any id the caller
 * can see.  Where Citus distributes the outbox, each node enqueues with its
 * own sequence, which Citus leaves alone (it belongs to the extension): the
 * value goes into the top 48 bits and the node's group id into the low 16,
 * so that ids are unique in the cluster.  A shard that moved here brings
 * the ids of its old node, whose sequence may be ahead of this one's: the
 * caller gives the last unpublished id of the topic (idem_outbox_last_id)
 * as floor, and the sequence is moved past it when it is behind, so that
 * a topic's ids keep growing (and its keys' rows their order) across moves.
 */
int64
idem_outbox_next_id(int64 floor)
{
	int32		group;
	int64		value;

	if (!OidIsValid(cached_sequence))
	{
		Oid			seqid = RangeVarGetRelid(makeRangeVar(IDEM_SCHEMA, OUTBOX_SEQUENCE, -1),
											 NoLock, true);

		if (!OidIsValid(seqid))
			ereport(ERROR,
					(errcode(ERRCODE_UNDEFINED_OBJECT),
					 errmsg("sequence \"%s.%s\" does not exist", IDEM_SCHEMA, OUTBOX_SEQUENCE),
					 errhint("Reinstall the extension with DROP EXTENSION and CREATE EXTENSION.")));
		cached_sequence = seqid;
	}
	/* the caller's EXECUTE on the enqueue function is the permission */
	if (cached_distribution[IDEM_TABLE_OUTBOX] != IDEM_DIST_HASH)
		return nextval_internal(cached_sequence, false);

	/*
	 * Behind the topic's ids, the sequence is moved past them before this
	 * transaction's nextval holds it, if this transaction has not called
	 * nextval yet: see sequence_past.  And after nextval, if a value handed
	 * out meanwhile made the look stale.
	 */
	group = Max(idem_node_group(), 0);
	if (floor != PG_INT64_MIN &&
		sequence_last_value(cached_sequence) <= (floor >> NODE_GROUP_BITS))
		value = sequence_past(cached_sequence, floor >> NODE_GROUP_BITS);
	else
		value = nextval_internal(cached_sequence, false);
	if (floor != PG_INT64_MIN && value <= (floor >> NODE_GROUP_BITS))
		value = sequence_past(cached_sequence, floor >> NODE_GROUP_BITS);
	if (value >= (INT64CONST(1) << (63 - NODE_GROUP_BITS)))
		ereport(ERROR,
				(errcode(ERRCODE_SEQUENCE_GENERATOR_LIMIT_EXCEEDED),
				 errmsg("outbox id sequence \"%s.%s\" is past its limit for a distributed outbox (2^47)",
						IDEM_SCHEMA, OUTBOX_SEQUENCE)));
	return (value << NODE_GROUP_BITS) | group;
}

/*
 * Where Citus distributes the outbox, the last unpublished id of topic in
 * its shard open in rel, the floor of idem_outbox_next_id: from the (topic,
 * id) index of unpublished rows, read backwards under the latest snapshot
 * (rows committed since the transaction's snapshot count too).
 * PG_INT64_MIN if there is none, and on one node.
 */
int64
idem_outbox_last_id(Relation heap, text *topic)
{
	List	   *indexes;
	ListCell   *lc;
	int64		last = PG_INT64_MIN;

	if (cached_distribution[IDEM_TABLE_OUTBOX] != IDEM_DIST_HASH)
		return PG_INT64_MIN;
	indexes = RelationGetIndexList(heap);

	foreach(lc, indexes)
	{
		Relation	index = index_open(lfirst_oid(lc), AccessShareLock);
		Form_pg_index form = index->rd_index;
		IndexScanDesc scan;
		ScanKeyData key;
		TupleTableSlot *slot;

		if (form->indnatts != 2 || form->indkey.values[0] != Anum_outbox_topic ||
			form->indkey.values[1] != Anum_outbox_id)
		{
			index_close(index, AccessShareLock);
			continue;
		}
		ScanKeyInit(&key, 1, BTEqualStrategyNumber, F_TEXTEQ, PointerGetDatum(topic));
		key.sk_collation = C_COLLATION_OID;
		slot = table_slot_create(heap, NULL);
		scan = compat_index_beginscan(heap, index, GetLatestSnapshot(), 1, 0);
		index_rescan(scan, &key, 1, NULL, 0);
		if (index_getnext_slot(scan, BackwardScanDirection, slot))
		{
			bool		isnull;

			last = DatumGetInt64(slot_getattr(slot, Anum_outbox_id, &isnull));
		}
		index_endscan(scan);
		ExecDropSingleTupleTableSlot(slot);
		index_close(index, AccessShareLock);
		break;
	}
	list_free(indexes);
	return last;
}

/*
 * Replace the row at tid.  With wait = false, a row that another transaction
 * is modifying or has locked is left alone (TM_BeingModified).  TM_Updated
 * and TM_Deleted mean it changed since the probe: probe again.
 */
TM_Result
idem_update(IdemRelation *rel, ItemPointer tid, Datum *values, bool *nulls,
			bool wait)
{
	TupleTableSlot *slot = make_slot(rel, values, nulls);
	TM_FailureData tmfd;
	LockTupleMode lockmode;
	CompatUpdateIndexes update_indexes;
	TM_Result	result;

	/* as the executor would: a published table must be able to log it */
	CheckCmdReplicaIdentity(rel->heap, CMD_UPDATE);
	result = table_tuple_update(rel->heap, tid, slot, GetCurrentCommandId(true),
								InvalidSnapshot, InvalidSnapshot, wait,
								&tmfd, &lockmode, &update_indexes);
	if (result == TM_Ok)
	{
		remember_own_row(rel, &slot->tts_tid);
		/* a HOT update (the usual case) needs no index entries */
		if (COMPAT_UPDATE_NEEDS_ANY_INDEX(update_indexes))
			insert_index_entries(rel, slot, UNIQUE_CHECK_YES, true, update_indexes);
		CommandCounterIncrement();
	}
	ExecDropSingleTupleTableSlot(slot);
	return result;
}

/* Delete the row at tid; results as for idem_update. */
TM_Result
idem_delete(IdemRelation *rel, ItemPointer tid, bool wait)
{
	TM_FailureData tmfd;
	TM_Result	result;

	CheckCmdReplicaIdentity(rel->heap, CMD_DELETE);
	result = table_tuple_delete(rel->heap, tid, GetCurrentCommandId(true),
								InvalidSnapshot, InvalidSnapshot, wait,
								&tmfd, false);
	if (result == TM_Ok)
		CommandCounterIncrement();
	return result;
}
