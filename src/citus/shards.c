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
 * Owns: the Citus lookups (how a table is distributed, shard id, local
 *	  placement, the shards placed on this node, this node's group, the
 *	  functions Citus delegates), and the caches of what they look up by
 *	  name (the comment above callbacks_registered).
 * May call: the catalogs, and Citus's SQL functions through the fmgr.
 *	  Called, through shards.h, by tables/, worker/purge.c, outbox/outbox_sql.c
 *	  and citus/delegation_guard.c.
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
#include "utils/syscache.h"

#include "citus/shards.h"

/*
 * Citus's catalogs (in pg_catalog) and the columns of theirs that are read,
 * by name.
 */
typedef enum DistCatalog
{
	DIST_PARTITION,
	DIST_SHARD,
	DIST_PLACEMENT,
	DIST_OBJECT,
	DIST_LOCAL_GROUP,
	NUM_DIST_CATALOGS
} DistCatalog;

static const char *const catalog_names[NUM_DIST_CATALOGS] = {
	[DIST_PARTITION] = "pg_dist_partition",
	[DIST_SHARD] = "pg_dist_shard",
	[DIST_PLACEMENT] = "pg_dist_placement",
	[DIST_OBJECT] = "pg_dist_object",
	[DIST_LOCAL_GROUP] = "pg_dist_local_group",
};

/* the index scanned, where Citus has one on the columns looked up by */
static const char *const catalog_indexes[NUM_DIST_CATALOGS] = {
	[DIST_PLACEMENT] = "pg_dist_placement_shardid_index",
	[DIST_OBJECT] = "pg_dist_object_pkey",
};

typedef enum DistColumn
{
	PARTITION_LOGICALRELID,
	PARTITION_PARTMETHOD,
	PARTITION_PARTKEY,
	SHARD_LOGICALRELID,
	SHARD_SHARDID,
	PLACEMENT_SHARDID,
	PLACEMENT_GROUPID,
	OBJECT_CLASSID,
	OBJECT_OBJID,
	OBJECT_DISTRIBUTION_ARGUMENT_INDEX,
	LOCAL_GROUP_GROUPID,
	NUM_DIST_COLUMNS
} DistColumn;

static const struct
{
	DistCatalog catalog;
	const char *name;
	Oid			typid;			/* the type Citus gives it */
}			column_defs[NUM_DIST_COLUMNS] = {
	[PARTITION_LOGICALRELID] = {DIST_PARTITION, "logicalrelid", REGCLASSOID},
	[PARTITION_PARTMETHOD] = {DIST_PARTITION, "partmethod", CHAROID},
	[PARTITION_PARTKEY] = {DIST_PARTITION, "partkey", TEXTOID},
	[SHARD_LOGICALRELID] = {DIST_SHARD, "logicalrelid", REGCLASSOID},
	[SHARD_SHARDID] = {DIST_SHARD, "shardid", INT8OID},
	[PLACEMENT_SHARDID] = {DIST_PLACEMENT, "shardid", INT8OID},
	[PLACEMENT_GROUPID] = {DIST_PLACEMENT, "groupid", INT4OID},
	[OBJECT_CLASSID] = {DIST_OBJECT, "classid", OIDOID},
	[OBJECT_OBJID] = {DIST_OBJECT, "objid", OIDOID},
	[OBJECT_DISTRIBUTION_ARGUMENT_INDEX] = {DIST_OBJECT, "distribution_argument_index", INT4OID},
	[LOCAL_GROUP_GROUPID] = {DIST_LOCAL_GROUP, "groupid", INT4OID},
};

/*
 * What is looked up by name once and kept until an invalidation drops it
 * (forget_relation, forget_names, forget_functions):
 *
 * - the catalogs' and indexes' OIDs (InvalidOid: no such catalog, Citus
 *	 is not installed in this database) and the columns' attribute numbers
 *	 (InvalidAttrNumber: no such column of that type: a catalog made or
 *	 altered by hand is read, never trusted): dropped when the relcache
 *	 entry of one of the catalogs is (ALTER, DROP EXTENSION citus), and,
 *	 while a catalog is missing, when any name in pg_class changes
 *	 (CREATE EXTENSION citus);
 * - how each table that was asked about is distributed: dropped with the
 *	 table's relcache entry, which Citus invalidates whenever its row in
 *	 pg_dist_partition changes (and with the catalogs);
 * - whether a function is delegated, and this node's group: dropped when
 *	 Citus invalidates pg_dist_object's or pg_dist_local_group's relcache
 *	 entry, as it does on every change of theirs (and with the catalogs);
 * - the OIDs of Citus's functions called: dropped on any change in
 *	 pg_proc's names.
 *
 * The placements (pg_dist_placement) and shards (pg_dist_shard) are read
 * afresh every time, after the shard's lock: a move changes them.
 */
static bool callbacks_registered = false;
static bool names_known = false;
static bool catalog_missing = false;
static Oid	catalog_oids[NUM_DIST_CATALOGS];
static Oid	index_oids[NUM_DIST_CATALOGS];
static AttrNumber column_attnums[NUM_DIST_COLUMNS];

#define MAX_KNOWN_TABLES 16
static struct
{
	Oid			relid;
	IdemDistribution distribution;
	AttrNumber	column;
}			known_tables[MAX_KNOWN_TABLES];
static int	next_known_table = 0;

#define MAX_KNOWN_FUNCTIONS 64
static struct
{
	Oid			funcid;
	bool		delegated;
}			known_functions[MAX_KNOWN_FUNCTIONS];
static int	next_known_function = 0;

static bool group_known = false;
static int32 known_group = -1;

/* Citus's functions that are called, by name and argument types */
typedef enum DistFunction
{
	FN_SHARD_ID_FOR_VALUE,
	FN_LOCK_SHARD_METADATA,
	NUM_DIST_FUNCTIONS
} DistFunction;

static Oid	function_oids[NUM_DIST_FUNCTIONS];

static void
forget_facts(void)
{
	memset(known_tables, 0, sizeof(known_tables));
	memset(known_functions, 0, sizeof(known_functions));
	group_known = false;
}

static void
forget_names(void)
{
	names_known = false;
	forget_facts();
}

/* relcache invalidation: see above */
static void
forget_relation(Datum arg, Oid relid)
{
	if (!OidIsValid(relid))
	{
		forget_names();
		return;
	}
	for (int i = 0; i < NUM_DIST_CATALOGS; i++)
		if (names_known && relid == catalog_oids[i])
		{
			forget_names();
			return;
		}
	for (int i = 0; i < MAX_KNOWN_TABLES; i++)
		if (known_tables[i].relid == relid)
			known_tables[i].relid = InvalidOid;
}

/* pg_class's names changed (or a cache reset): only a missing catalog cares */
static void
forget_missing_names(Datum arg, int cacheid, uint32 hashvalue)
{
	if (hashvalue == 0 || catalog_missing)
		forget_names();
}

static void
forget_functions(Datum arg, int cacheid, uint32 hashvalue)
{
	memset(function_oids, 0, sizeof(function_oids));
}

static void
register_callbacks(void)
{
	if (callbacks_registered)
		return;
	CacheRegisterRelcacheCallback(forget_relation, (Datum) 0);
	CacheRegisterSyscacheCallback(RELNAMENSP, forget_missing_names, (Datum) 0);
	CacheRegisterSyscacheCallback(PROCNAMEARGSNSP, forget_functions, (Datum) 0);
	callbacks_registered = true;
}

/* Look the catalogs and their columns up by name, unless known already. */
static void
know_names(void)
{
	register_callbacks();
	if (names_known)
		return;
	catalog_missing = false;
	for (int i = 0; i < NUM_DIST_CATALOGS; i++)
	{
		catalog_oids[i] = get_relname_relid(catalog_names[i], PG_CATALOG_NAMESPACE);
		index_oids[i] = catalog_indexes[i] != NULL ?
			get_relname_relid(catalog_indexes[i], PG_CATALOG_NAMESPACE) : InvalidOid;
		if (!OidIsValid(catalog_oids[i]))
			catalog_missing = true;
	}
	for (int i = 0; i < NUM_DIST_COLUMNS; i++)
	{
		Oid			catalog = catalog_oids[column_defs[i].catalog];
		AttrNumber	attnum = OidIsValid(catalog) ?
			get_attnum(catalog, column_defs[i].name) : InvalidAttrNumber;

		if (attnum != InvalidAttrNumber &&
			get_atttype(catalog, attnum) != column_defs[i].typid)
			attnum = InvalidAttrNumber;
		column_attnums[i] = attnum;
	}
	names_known = true;
}

/*
 * Is Citus's metadata in this database at all (its catalog of distributed
 * tables)?  Cheap once known.
 */
bool
idem_cluster_metadata_exists(void)
{
	know_names();
	return OidIsValid(catalog_oids[DIST_PARTITION]);
}

/* One column of the rows of a Citus catalog that catalog_column read. */
typedef struct CitusColumn
{
	int			nrows;			/* -1: no such catalog (Citus is not installed) */
	Datum	   *values;			/* copied out */
	bool	   *nulls;
} CitusColumn;

/* A scan key on a catalog's column: key_column's attnum, or false. */
static bool
column_key(ScanKey key, DistColumn column, RegProcedure eqproc, Datum value)
{
	if (column_attnums[column] == InvalidAttrNumber)
		return false;
	ScanKeyInit(key, column_attnums[column], BTEqualStrategyNumber, eqproc, value);
	return true;
}

/*
 * Column column of the rows of its catalog that match the scan keys, in
 * the order of the catalog's index where Citus has one, read once, the
 * catalog closed again.  No rows (-1) when the catalog or a key's column
 * is missing; NULLs when the column is.
 */
static CitusColumn
catalog_column(DistColumn column, int nkeys, ScanKey keys, bool keys_valid)
{
	DistCatalog which = column_defs[column].catalog;
	Oid			catalog_id;
	Oid			index_id;
	AttrNumber	attnum;
	CitusColumn result = {-1, NULL, NULL};
	int			capacity = 4;
	Relation	catalog;
	Form_pg_attribute att = NULL;
	SysScanDesc scan;
	HeapTuple	tuple;

	know_names();
	catalog_id = catalog_oids[which];
	index_id = index_oids[which];
	attnum = column_attnums[column];
	if (!OidIsValid(catalog_id) || !keys_valid)
		return result;
	catalog = table_open(catalog_id, AccessShareLock);
	if (attnum != InvalidAttrNumber)
		att = TupleDescAttr(RelationGetDescr(catalog), attnum - 1);
	result.nrows = 0;
	result.values = palloc(sizeof(Datum) * capacity);
	result.nulls = palloc(sizeof(bool) * capacity);
	scan = systable_beginscan(catalog, index_id, OidIsValid(index_id), NULL, nkeys, keys);
	while (HeapTupleIsValid(tuple = systable_getnext(scan)))
	{
		Datum		value = (Datum) 0;
		bool		isnull = true;

		if (result.nrows == capacity)
		{
			capacity *= 2;
			result.values = repalloc(result.values, sizeof(Datum) * capacity);
			result.nulls = repalloc(result.nulls, sizeof(bool) * capacity);
		}
		if (att != NULL)
			value = heap_getattr(tuple, attnum, RelationGetDescr(catalog), &isnull);
		result.values[result.nrows] = isnull ? (Datum) 0 :
			datumCopy(value, att->attbyval, att->attlen);
		result.nulls[result.nrows++] = isnull;
	}
	systable_endscan(scan);
	table_close(catalog, AccessShareLock);
	return result;
}

/*
 * A column of the table's row in pg_dist_partition; false when Citus does
 * not know the table (or is not installed).  NULL (*isnull) too when the
 * catalog has no such column of the type Citus gives it.
 */
static bool
dist_partition_attr(Oid relid, DistColumn column, Datum *value, bool *isnull)
{
	ScanKeyData key;
	CitusColumn rows;
	bool		valid;

	know_names();
	valid = column_key(&key, PARTITION_LOGICALRELID, F_OIDEQ, ObjectIdGetDatum(relid));
	rows = catalog_column(column, 1, &key, valid);
	if (rows.nrows <= 0)
		return false;
	*value = rows.values[0];
	*isnull = rows.nulls[0];
	return true;
}

/*
 * The column Citus distributes the table by: the varattno of the Var that
 * pg_dist_partition.partkey holds as text ("{VAR :varno 1 :varattno 2
 * ..."), or InvalidAttrNumber when there is none (a reference table) or
 * Citus does not know the table.
 */
static AttrNumber
partkey_column(Oid relid)
{
	Datum		value;
	bool		isnull;
	char	   *partkey;
	char	   *field;
	AttrNumber	attnum = InvalidAttrNumber;

	if (!dist_partition_attr(relid, PARTITION_PARTKEY, &value, &isnull) || isnull)
		return InvalidAttrNumber;
	partkey = TextDatumGetCString(value);
	field = strstr(partkey, ":varattno ");
	if (field != NULL)
		attnum = (AttrNumber) strtol(field + strlen(":varattno "), NULL, 10);
	pfree(partkey);
	return attnum;
}

/* The known_tables entry of the table, read from pg_dist_partition if not known. */
static int
known_table(Oid relid)
{
	int			slot;
	Datum		value;
	bool		isnull;
	IdemDistribution distribution = IDEM_DIST_LOCAL;
	AttrNumber	column = InvalidAttrNumber;

	know_names();
	for (int i = 0; i < MAX_KNOWN_TABLES; i++)
		if (known_tables[i].relid == relid)
			return i;
	/*
	 * pg_dist_partition.partmethod: 'h' hash; 'n' none (a reference or
	 * Citus local table), 'r' range, 'a' append, or NULL in a catalog made
	 * by hand: other.
	 */
	if (dist_partition_attr(relid, PARTITION_PARTMETHOD, &value, &isnull))
	{
		distribution = !isnull && DatumGetChar(value) == 'h' ?
			IDEM_DIST_HASH : IDEM_DIST_OTHER;
		if (distribution == IDEM_DIST_HASH)
			column = partkey_column(relid);
	}
	slot = next_known_table;
	next_known_table = (next_known_table + 1) % MAX_KNOWN_TABLES;
	known_tables[slot].relid = relid;
	known_tables[slot].distribution = distribution;
	known_tables[slot].column = column;
	return slot;
}

/*
 * How the cluster distributes the table: not at all (an ordinary table,
 * or Citus is not installed), by hash (its rows are in shards), or some
 * other way.
 */
IdemDistribution
idem_table_distribution(Oid relid)
{
	return known_tables[known_table(relid)].distribution;
}

/*
 * The name of the column a hash-distributed table is distributed by; an
 * ERROR when Citus's catalog does not say (a usable partkey).
 */
const char *
idem_distribution_column(Relation rel)
{
	AttrNumber	attnum = known_tables[known_table(RelationGetRelid(rel))].column;
	TupleDesc	desc = RelationGetDescr(rel);

	if (attnum > 0 && attnum <= desc->natts && !TupleDescAttr(desc, attnum - 1)->attisdropped)
		return NameStr(TupleDescAttr(desc, attnum - 1)->attname);
	ereport(ERROR,
			(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
			 errmsg("Citus's catalog does not say which column table \"%s.%s\" is distributed by",
					get_namespace_name(RelationGetNamespace(rel)), RelationGetRelationName(rel)),
			 errdetail("pg_dist_partition lists it as hash-distributed, with no usable partkey.")));
	return NULL;				/* not reached */
}

/*
 * A function of Citus's in pg_catalog, looked up once (function_oids),
 * or an ERROR saying Citus is missing.
 */
static Oid
citus_function(DistFunction which, const char *name, int nargs, const Oid *argtypes)
{
	Oid			fn = function_oids[which];

	register_callbacks();
	if (OidIsValid(fn))
		return fn;
	fn = LookupFuncName(list_make2(makeString("pg_catalog"), makeString((char *) name)),
						nargs, argtypes, true);
	function_oids[which] = fn;
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
	Oid			fn = citus_function(FN_SHARD_ID_FOR_VALUE, "get_shard_id_for_distribution_column", 2, argtypes);
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
	Oid			fn = citus_function(FN_LOCK_SHARD_METADATA, "lock_shard_metadata", 2, argtypes);
	Datum		element = Int64GetDatum(shard);
	ArrayType  *shards = construct_array(&element, 1, INT8OID, sizeof(int64),
										 FLOAT8PASSBYVAL, TYPALIGN_DOUBLE);

	OidFunctionCall2(fn, Int32GetDatum(ShareLock), PointerGetDatum(shards));
}

/* This node's group in the cluster (pg_dist_local_group), or -1. */
int32
idem_node_group(void)
{
	CitusColumn column;

	know_names();
	if (group_known)
		return known_group;
	column = catalog_column(LOCAL_GROUP_GROUPID, 0, NULL, true);
	known_group = column.nrows > 0 && !column.nulls[0] ? DatumGetInt32(column.values[0]) : -1;
	group_known = true;
	return known_group;
}

/* Has the shard a placement in this group? */
static bool
placed_in_group(int64 shard, int32 group)
{
	ScanKeyData key;
	CitusColumn column;
	bool		valid;

	know_names();
	valid = column_key(&key, PLACEMENT_SHARDID, F_INT8EQ, Int64GetDatum(shard));
	column = catalog_column(PLACEMENT_GROUPID, 1, &key, valid);
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

	relid = placed_in_group(shard, idem_node_group()) ? shard_relation(shell, shard) : InvalidOid;
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
	bool		valid;

	know_names();
	valid = column_key(&key, SHARD_LOGICALRELID, F_OIDEQ, ObjectIdGetDatum(shell));
	column = catalog_column(SHARD_SHARDID, 1, &key, valid);
	if (column.nrows <= 0)
		return NIL;
	group = idem_node_group();
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
	return placed_in_group(shard, idem_node_group());
}

/*
 * Does Citus delegate calls of the function to the node of a shard: is it
 * a distributed function (pg_dist_object) with a distribution argument?
 * False where Citus is not installed.
 */
bool
idem_function_delegated(Oid funcid)
{
	ScanKeyData keys[2];
	CitusColumn column;
	bool		valid;
	bool		delegated = false;
	int			slot;

	know_names();
	for (int i = 0; i < MAX_KNOWN_FUNCTIONS; i++)
		if (known_functions[i].funcid == funcid)
			return known_functions[i].delegated;
	valid = column_key(&keys[0], OBJECT_CLASSID, F_OIDEQ, ObjectIdGetDatum(ProcedureRelationId)) &&
		column_key(&keys[1], OBJECT_OBJID, F_OIDEQ, ObjectIdGetDatum(funcid));
	column = catalog_column(OBJECT_DISTRIBUTION_ARGUMENT_INDEX, 2, keys, valid);
	for (int i = 0; i < column.nrows; i++)
		if (!column.nulls[i])
			delegated = true;
	slot = next_known_function;
	next_known_function = (next_known_function + 1) % MAX_KNOWN_FUNCTIONS;
	known_functions[slot].funcid = funcid;
	known_functions[slot].delegated = delegated;
	return delegated;
}
