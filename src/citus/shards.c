/*-------------------------------------------------------------------------
 *
 * shards.c
 *	  Where a row of a table that Citus distributes lives: the shard that
 *	  holds a distribution value, and whether this node holds it.
 *
 * When Citus hash-distributes keys (by scope), processed_events (by
 * consumer) or outbox (by topic), the table each node has under that name
 * is an empty shell: the rows are in shards, tables named
 * "<table>_<shard id>" in the same schema, placed on the worker nodes.  The
 * direct path (tables.c) bypasses the executor, and so Citus's router, so
 * it must find the shard itself.  Citus delegates a distributed function
 * call to the node of the shard that holds its distribution argument; there
 * this module names the shard and opens it, and anywhere else it refuses,
 * rather than read or write a shell.
 *
 * Nothing here links against Citus: the shard id comes from Citus's own
 * SQL-callable get_shard_id_for_distribution_column (its metadata cache,
 * its hash function and its shard intervals), called through the fmgr; the
 * placement from the catalogs pg_dist_placement and pg_dist_local_group,
 * which Citus keeps on every node that has its metadata.  Before a shard is
 * read or written, its metadata lock is taken in ShareLock, as Citus's
 * executor does before a write (Citus's lock_shard_metadata): a shard move
 * or split takes it in ExclusiveLock on every node before it switches the
 * placement, so that no write lands on the old placement after its last
 * catch-up.  The placement is read after that lock, from a fresh catalog
 * snapshot.
 *
 * Owns: the Citus lookups (partition method, shard id, local placement,
 *	  the shards placed on this node, this node's group, the functions Citus
 *	  delegates).
 * May call: the catalogs, and Citus's SQL functions through the fmgr.
 *	  Called by tables/tables.c and citus/delegation_guard.c.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "catalog/namespace.h"
#include "catalog/pg_collation.h"
#include "catalog/pg_namespace.h"
#include "catalog/pg_proc.h"
#include "catalog/pg_type.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "nodes/makefuncs.h"
#include "parser/parse_func.h"
#include "storage/lmgr.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/datum.h"
#include "utils/fmgroids.h"
#include "utils/guc.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"

#include "citus/shards.h"

/* pg_dist_partition (logicalrelid, partmethod, ...) */
#define Anum_dist_partition_logicalrelid 1
#define Anum_dist_partition_partmethod 2
#define Anum_dist_partition_partkey 3
/* pg_dist_shard (logicalrelid, shardid, ...) */
#define Anum_dist_shard_logicalrelid 1
#define Anum_dist_shard_shardid 2
/* pg_dist_placement (placementid, shardid, shardstate, shardlength, groupid) */
#define Anum_dist_placement_shardid 2
#define Anum_dist_placement_groupid 5
/* pg_dist_object (classid, objid, objsubid, type, object_names, object_args,
 * distribution_argument_index, ...) */
#define Anum_dist_object_classid 1
#define Anum_dist_object_objid 2
#define Anum_dist_object_distribution_argument_index 7
/* pg_dist_local_group (groupid) */
#define Anum_dist_local_group_groupid 1

static Oid
citus_catalog(const char *name)
{
	return get_relname_relid(name, PG_CATALOG_NAMESPACE);
}

/* One column of the rows of a Citus catalog that citus_catalog_column read. */
typedef struct CitusColumn
{
	int			nrows;			/* -1: no such catalog (Citus is not installed) */
	Datum	   *values;			/* copied out */
	bool	   *nulls;
} CitusColumn;

/*
 * Column attnum, of type typid, of the rows of Citus's catalog name (in
 * pg_catalog) that match the scan keys (on the catalog's attribute
 * numbers), in the order of its index index_name where Citus has it, read
 * once, the catalog closed again.  A column the catalog lacks or has of
 * another type reads as NULL: a catalog made or altered by hand is read,
 * never trusted.
 */
static CitusColumn
citus_catalog_column(const char *name, const char *index_name, int nkeys, ScanKey keys,
					 AttrNumber attnum, Oid typid)
{
	Oid			catalog_id = citus_catalog(name);
	Oid			index_id = index_name != NULL ? citus_catalog(index_name) : InvalidOid;
	CitusColumn column = {-1, NULL, NULL};
	int			capacity = 4;
	Relation	catalog;
	TupleDesc	desc;
	Form_pg_attribute att;
	SysScanDesc scan;
	HeapTuple	tuple;

	if (!OidIsValid(catalog_id))
		return column;
	catalog = table_open(catalog_id, AccessShareLock);
	desc = RelationGetDescr(catalog);
	att = attnum <= desc->natts ? TupleDescAttr(desc, attnum - 1) : NULL;
	if (att != NULL && (att->attisdropped || att->atttypid != typid))
		att = NULL;
	column.nrows = 0;
	column.values = palloc(sizeof(Datum) * capacity);
	column.nulls = palloc(sizeof(bool) * capacity);
	scan = systable_beginscan(catalog, index_id, OidIsValid(index_id), NULL, nkeys, keys);
	while (HeapTupleIsValid(tuple = systable_getnext(scan)))
	{
		Datum		value = (Datum) 0;
		bool		isnull = true;

		if (column.nrows == capacity)
		{
			capacity *= 2;
			column.values = repalloc(column.values, sizeof(Datum) * capacity);
			column.nulls = repalloc(column.nulls, sizeof(bool) * capacity);
		}
		if (att != NULL)
			value = heap_getattr(tuple, attnum, desc, &isnull);
		column.values[column.nrows] = isnull ? (Datum) 0 :
			datumCopy(value, att->attbyval, att->attlen);
		column.nulls[column.nrows++] = isnull;
	}
	systable_endscan(scan);
	table_close(catalog, AccessShareLock);
	return column;
}

/*
 * A column of the table's row in pg_dist_partition; false when Citus does
 * not know the table (or is not installed).  NULL (*isnull) too when the
 * catalog has no such column of the type Citus gives it (typid).
 */
static bool
dist_partition_attr(Oid relid, AttrNumber attnum, Oid typid, Datum *value, bool *isnull)
{
	ScanKeyData key;
	CitusColumn column;

	ScanKeyInit(&key, Anum_dist_partition_logicalrelid, BTEqualStrategyNumber,
				F_OIDEQ, ObjectIdGetDatum(relid));
	column = citus_catalog_column("pg_dist_partition", NULL, 1, &key, attnum, typid);
	if (column.nrows <= 0)
		return false;
	*value = column.values[0];
	*isnull = column.nulls[0];
	return true;
}

/*
 * How Citus distributes the table: its partmethod in pg_dist_partition
 * ('h' hash, 'n' none, i.e. a reference or Citus local table, ...), or
 * '\0' when Citus does not know it (or is not installed).
 */
char
idem_citus_partmethod(Oid relid)
{
	Datum		value;
	bool		isnull;

	if (!dist_partition_attr(relid, Anum_dist_partition_partmethod, CHAROID, &value, &isnull))
		return '\0';
	return isnull ? '?' : DatumGetChar(value);
}

/*
 * The column Citus distributes the table by: the varattno of the Var that
 * pg_dist_partition.partkey holds as text ("{VAR :varno 1 :varattno 2
 * ..."), or InvalidAttrNumber when there is none (a reference table) or
 * Citus does not know the table.
 */
AttrNumber
idem_citus_distribution_column(Oid relid)
{
	Datum		value;
	bool		isnull;
	char	   *partkey;
	char	   *field;
	AttrNumber	attnum = InvalidAttrNumber;

	if (!dist_partition_attr(relid, Anum_dist_partition_partkey, TEXTOID, &value, &isnull) || isnull)
		return InvalidAttrNumber;
	partkey = TextDatumGetCString(value);
	field = strstr(partkey, ":varattno ");
	if (field != NULL)
		attnum = (AttrNumber) strtol(field + strlen(":varattno "), NULL, 10);
	pfree(partkey);
	return attnum;
}

/* A function of Citus's in pg_catalog, or an ERROR saying Citus is missing. */
static Oid
citus_function(const char *name, int nargs, const Oid *argtypes)
{
	Oid			fn = LookupFuncName(list_make2(makeString("pg_catalog"),
											   makeString((char *) name)),
									nargs, argtypes, true);

	if (!OidIsValid(fn))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("function pg_catalog.%s of Citus does not exist", name),
				 errdetail("An extension table is distributed by Citus, and idempotency finds its shards with Citus's functions."),
				 errhint("Install the citus extension in this database.")));
	return fn;
}

/*
 * get_shard_id_for_distribution_column(shell, value): its second argument
 * is "any", which it reads the type of from the call expression, so the
 * call is given one.
 */
static int64
shard_id_for_value(Oid shell, text *value)
{
	static const Oid argtypes[2] = {REGCLASSOID, ANYOID};
	Oid			fn = citus_function("get_shard_id_for_distribution_column", 2, argtypes);
	FmgrInfo	flinfo;
	FuncExpr   *expr;
	Datum		result;

	LOCAL_FCINFO(fcinfo, 2);

	expr = makeFuncExpr(fn, INT8OID,
						list_make2(makeConst(REGCLASSOID, -1, InvalidOid, sizeof(Oid),
											 ObjectIdGetDatum(shell), false, true),
								   makeConst(TEXTOID, -1, C_COLLATION_OID, -1,
											 PointerGetDatum(value), false, false)),
						InvalidOid, C_COLLATION_OID, COERCE_EXPLICIT_CALL);
	fmgr_info(fn, &flinfo);
	fmgr_info_set_expr((Node *) expr, &flinfo);
	InitFunctionCallInfoData(*fcinfo, &flinfo, 2, C_COLLATION_OID, NULL, NULL);
	fcinfo->args[0].value = ObjectIdGetDatum(shell);
	fcinfo->args[0].isnull = false;
	fcinfo->args[1].value = PointerGetDatum(value);
	fcinfo->args[1].isnull = false;
	result = FunctionCallInvoke(fcinfo);
	if (fcinfo->isnull)
		elog(ERROR, "get_shard_id_for_distribution_column returned NULL");
	return DatumGetInt64(result);
}

/* lock_shard_metadata(ShareLock, ARRAY[shard]): see the top of this file */
static void
lock_shard_metadata(int64 shard)
{
	static const Oid argtypes[2] = {INT4OID, INT8ARRAYOID};
	Oid			fn = citus_function("lock_shard_metadata", 2, argtypes);
	Datum		element = Int64GetDatum(shard);
	ArrayType  *shards = construct_array(&element, 1, INT8OID, sizeof(int64),
										 FLOAT8PASSBYVAL, TYPALIGN_DOUBLE);

	OidFunctionCall2(fn, Int32GetDatum(ShareLock), PointerGetDatum(shards));
}

/* This node's group in the cluster (pg_dist_local_group), or -1. */
int32
idem_citus_local_group(void)
{
	CitusColumn column = citus_catalog_column("pg_dist_local_group", NULL, 0, NULL,
											  Anum_dist_local_group_groupid, INT4OID);

	return column.nrows > 0 && !column.nulls[0] ? DatumGetInt32(column.values[0]) : -1;
}

/* Has the shard a placement in this group? */
static bool
placed_in_group(int64 shard, int32 group)
{
	ScanKeyData key;
	CitusColumn column;

	ScanKeyInit(&key, Anum_dist_placement_shardid, BTEqualStrategyNumber,
				F_INT8EQ, Int64GetDatum(shard));
	column = citus_catalog_column("pg_dist_placement", "pg_dist_placement_shardid_index",
								  1, &key, Anum_dist_placement_groupid, INT4OID);
	for (int i = 0; i < column.nrows; i++)
		if (!column.nulls[i] && DatumGetInt32(column.values[i]) == group)
			return true;
	return false;
}

/* The shard's table, "<table>_<shard>" in the shell's schema (or InvalidOid). */
static Oid
shard_relation(Oid shell, int64 shard)
{
	char		name[NAMEDATALEN * 2];

	snprintf(name, sizeof(name), "%s_" INT64_FORMAT, get_rel_name(shell), shard);
	if (strlen(name) >= NAMEDATALEN)
		return InvalidOid;		/* Citus shortens such names; ours never are */
	return get_relname_relid(name, get_rel_namespace(shell));
}

/*
 * The shard of the hash-distributed table shell that holds value, with its
 * metadata lock held (ShareLock) until the end of the transaction, looked up
 * again after the lock, since a split may have replaced the shard while we
 * waited.  Citus's functions run as the table's owner, who may read Citus's
 * metadata whatever the caller's privileges.
 */
static int64
lock_shard_of_value(Relation shell_rel, text *value, const char *function_name)
{
	Oid			shell = RelationGetRelid(shell_rel);
	Oid			saved_userid;
	int			saved_sec_context;
	int64		shard;
	int64		locked = -1;		/* no shard id */

	GetUserIdAndSecContext(&saved_userid, &saved_sec_context);
	SetUserIdAndSecContext(shell_rel->rd_rel->relowner,
						   saved_sec_context | SECURITY_LOCAL_USERID_CHANGE);
	for (;;)
	{
		shard = shard_id_for_value(shell, value);
		if (shard == locked)
			break;
		/* Citus answers 0 when no shard covers the value: its metadata is broken */
		if (shard == 0)
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("%s cannot run: Citus has no shard of table \"%s.%s\" for \"%s\"",
							function_name,
							get_namespace_name(get_rel_namespace(shell)), get_rel_name(shell),
							text_to_cstring(value)),
					 errdetail("pg_dist_shard has no shard whose hash range covers the value.")));
		lock_shard_metadata(shard);
		locked = shard;
		AcceptInvalidationMessages();
		InvalidateCatalogSnapshot();
	}
	SetUserIdAndSecContext(saved_userid, saved_sec_context);
	return shard;
}

/*
 * Did Citus send this backend its query: is it one of the connections a
 * Citus node opens to another (application_name "citus_internal gpid=N",
 * as Citus names them)?
 */
static bool
sent_by_citus(void)
{
	return application_name != NULL &&
		strncmp(application_name, "citus_internal gpid=", strlen("citus_internal gpid=")) == 0;
}

/*
 * The shard of the hash-distributed table shell that holds value, when
 * this node holds it: its OID, not locked, with the shard's metadata lock
 * held until the end of the transaction.  Otherwise an ERROR: a retryable
 * one (40001) when Citus sent the call here, where its metadata placed the
 * shard when the call was planned and from where the shard has moved since
 * (the move held the lock this call waited for); else one saying how to
 * call the function so that Citus runs it where the shard is (55000).
 */
Oid
idem_shard_for_value(Relation shell_rel, text *value, const char *function_name)
{
	Oid			shell = RelationGetRelid(shell_rel);
	int64		shard = lock_shard_of_value(shell_rel, value, function_name);
	Oid			relid;

	relid = placed_in_group(shard, idem_citus_local_group()) ? shard_relation(shell, shard) : InvalidOid;
	if (!OidIsValid(relid) && sent_by_citus())
		ereport(ERROR,
				(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
				 errmsg("%s cannot run on this node: shard " INT64_FORMAT " of table \"%s.%s\" is no longer placed here",
						function_name, shard,
						get_namespace_name(get_rel_namespace(shell)), get_rel_name(shell)),
				 errdetail("Citus sent the call to the node its metadata named for the shard when the call was planned, and the shard has moved to another node since."),
				 errhint("Retry the transaction: Citus sends the call to the shard's new node.")));
	if (!OidIsValid(relid))
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("%s cannot run on this node: shard " INT64_FORMAT " of table \"%s.%s\" is not placed here",
						function_name, shard,
						get_namespace_name(get_rel_namespace(shell)), get_rel_name(shell)),
				 errdetail("Citus distributes the table, and the row for \"%s\" is in that shard, on another node.",
						   text_to_cstring(value)),
				 errhint("Call it as a distributed function, as the whole query (SELECT idempotency.%.*s(...)), so that Citus runs it on the node of the shard; idempotency.idem_distribute() declares the functions.",
						 (int) strcspn(function_name, "("), function_name)));
	return relid;
}

/*
 * Before Citus plans a call of function_name that it delegates to the node
 * of the shard of shell that holds value: take that shard's metadata lock
 * (ShareLock, until the end of the transaction) on the node that plans,
 * and read the placement afresh, as Citus's executor does before a router
 * write.  A shard move holds the lock (ExclusiveLock, on every node) from
 * before its last catch-up until its switch of the placement commits: a
 * call planned meanwhile waits, and Citus then sends it to the new node; a
 * call that holds the lock first runs on the old node, and the move waits
 * for it and copies its writes.  The shell and its colocated tables share
 * the shard group, and so the lock.
 */
void
idem_lock_shard_for_call(Relation shell_rel, text *value, const char *function_name)
{
	(void) lock_shard_of_value(shell_rel, value, function_name);
}

/*
 * The shards of the hash-distributed table shell that are placed on this
 * node, as their tables' OIDs in shard id order: what the background
 * worker purges here.
 */
List *
idem_local_shards(Oid shell)
{
	ScanKeyData key;
	CitusColumn column;
	int32		group;
	List	   *shards = NIL;

	ScanKeyInit(&key, Anum_dist_shard_logicalrelid, BTEqualStrategyNumber,
				F_OIDEQ, ObjectIdGetDatum(shell));
	column = citus_catalog_column("pg_dist_shard", NULL, 1, &key,
								  Anum_dist_shard_shardid, INT8OID);
	if (column.nrows <= 0)
		return NIL;
	group = idem_citus_local_group();
	for (int i = 0; i < column.nrows; i++)
	{
		Oid			relid;

		if (column.nulls[i] || !placed_in_group(DatumGetInt64(column.values[i]), group))
			continue;
		relid = shard_relation(shell, DatumGetInt64(column.values[i]));
		if (OidIsValid(relid))
			shards = lappend_oid(shards, relid);
	}
	list_sort(shards, list_oid_cmp);
	return shards;
}

/*
 * Lock the metadata of the shard whose table is relid (one of
 * idem_local_shards's), as a function does before it writes its shard
 * (idem_shard_for_value), and say whether the shard is still placed on this
 * node.  A move switches the placement holding that lock in ExclusiveLock:
 * a writer that holds it finishes on the old placement before the switch
 * (and its writes are copied), one that comes after finds the shard gone
 * from here, even while its old table waits for Citus's deferred drop.
 */
bool
idem_lock_local_shard(Oid relid)
{
	char	   *name = get_rel_name(relid);
	char	   *suffix = name != NULL ? strrchr(name, '_') : NULL;
	char	   *end;
	int64		shard;

	if (suffix == NULL)
		return false;
	errno = 0;
	shard = strtoi64(suffix + 1, &end, 10);
	if (errno != 0 || *end != '\0' || end == suffix + 1)
		return false;
	lock_shard_metadata(shard);
	AcceptInvalidationMessages();
	InvalidateCatalogSnapshot();
	return placed_in_group(shard, idem_citus_local_group());
}

/*
 * Does Citus delegate calls of the function to the node of a shard: is it
 * a distributed function (pg_dist_object) with a distribution argument?
 * False where Citus is not installed.
 */
bool
idem_citus_delegates_function(Oid funcid)
{
	ScanKeyData keys[2];
	CitusColumn column;

	ScanKeyInit(&keys[0], Anum_dist_object_classid, BTEqualStrategyNumber,
				F_OIDEQ, ObjectIdGetDatum(ProcedureRelationId));
	ScanKeyInit(&keys[1], Anum_dist_object_objid, BTEqualStrategyNumber,
				F_OIDEQ, ObjectIdGetDatum(funcid));
	column = citus_catalog_column("pg_dist_object", "pg_dist_object_pkey", 2, keys,
								  Anum_dist_object_distribution_argument_index, INT4OID);
	for (int i = 0; i < column.nrows; i++)
		if (!column.nulls[i])
			return true;
	return false;
}
