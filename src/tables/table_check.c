/*-------------------------------------------------------------------------
 *
 * table_check.c
 *	  The check that an extension table is still what the direct path was
 *	  built for.
 *
 * The functions read and write keys, processed_events and outbox without
 * the executor (tables.c).  That is safe only as long as the table is the
 * one the script created: the same columns with the same nullability and
 * collations, the same primary key, and nothing attached to it that the
 * executor would have honoured and the direct path skips — a CHECK or
 * NOT NULL of the operator's, a foreign key, a trigger, a rule, row-level
 * security, inheritance, partitioning, another table access method, or a
 * kind of Citus table other than a hash-distributed one (whose shards are
 * checked instead, each as the table itself: shards.c).  A superuser can add any of these; the utility
 * hook (guard.c) refuses the DDL on servers that preload the library, and
 * this check refuses the table itself everywhere, with what is wrong and
 * how to undo it.
 *
 * What the direct path can honour cheaply, it honours instead: indexes of
 * the operator's own (non-unique, on columns; tables.c maintains them), and
 * the replica identity, which tables.c checks before each update or delete
 * with the executor's own CheckCmdReplicaIdentity.
 *
 * The check runs when a backend first opens the table, and again after any
 * relcache invalidation of it (tables.c forgets the table's OID then):
 * every DDL this looks at invalidates the table's relcache entry, so the
 * hot path pays nothing.
 *
 * The answer must not depend on invalidations that arrive while it runs.
 * Each catalog it opens (pg_constraint, pg_inherits, a syscache miss) takes
 * in the invalidations queued meanwhile, and one of the table or a sinval
 * reset rebuilds the table's relcache entry under our feet: a rebuilt entry
 * has a new rd_rel and trigdesc (the old ones freed) and no rd_pkindex until
 * its index list is computed again.  So the check reads a field of the
 * entry through the Relation when it uses it, keeps no pointer into it
 * across a catalog access (copying what it needs first), pins the tuple
 * descriptor it walks, and takes the primary key once, through
 * RelationGetPrimaryKeyIndex, for everything that compares with it.
 *
 * May call: the catalogs, through the relcache and syscache; citus/shards.h,
 * compat.h.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/table.h"
#include "catalog/indexing.h"
#include "catalog/namespace.h"
#include "catalog/pg_am.h"
#include "catalog/pg_collation.h"
#include "catalog/pg_constraint.h"
#include "catalog/pg_inherits.h"
#include "catalog/pg_namespace.h"
#include "catalog/pg_trigger.h"
#include "catalog/partition.h"
#include "commands/defrem.h"
#include "rewrite/prs2lock.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"

#include "compat.h"
#include "citus/shards.h"
#include "tables/table_check.h"

#define IDEM_SCHEMA "idempotency"

/* Refuse the table: what is wrong with it, and how to undo that. */
static void
refuse(const ExpectedTable *def, int sqlstate, const char *detail,
	   const char *hint)
{
	ereport(ERROR,
			(errcode(sqlstate),
			 errmsg("idempotency does not support this change to table \"%s.%s\"",
					IDEM_SCHEMA, def->name),
			 errdetail_internal("%s", detail),
			 errhint("%s", hint)));
}

#define REFUSE(def, detail, hint) \
	refuse((def), ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE, (detail), (hint))

/* ... where one statement undoes it */
#define REFUSE_UNDO(def, detail, statement) \
	REFUSE((def), (detail), psprintf("Undo it with %s.", (statement)))

/* The collation a column of that kind must have. */
static Oid
expected_collation(const ExpectedColumn *column)
{
	if (column->c_collated)
		return C_COLLATION_OID;
	return get_typcollation(column->type);
}

/*
 * Its columns: names, types, nullability, collation; nothing computed.  The
 * descriptor is pinned: the lookups of types and collations may rebuild the
 * relcache entry, which can swap in another.
 */
static void
check_columns(Relation heap, const ExpectedTable *def, const char *qualified)
{
	TupleDesc	desc = RelationGetDescr(heap);

	PinTupleDesc(desc);

	for (int i = 0; i < Max(desc->natts, def->ncolumns); i++)
	{
		Form_pg_attribute attr = i < desc->natts ? TupleDescAttr(desc, i) : NULL;
		const ExpectedColumn *column = i < def->ncolumns ? &def->columns[i] : NULL;
		const char *name;

		/* the columns of a later version, all absent: the earlier version's table */
		if (attr == NULL && i == desc->natts && i >= def->ncolumns - def->noptional)
			break;
		if (attr == NULL || column == NULL || attr->attisdropped ||
			attr->atttypid != column->type ||
			strcmp(NameStr(attr->attname), column->name) != 0)
			ereport(ERROR,
					(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
					 errmsg("table \"%s\" does not have the columns this version of idempotency expects",
							qualified),
					 column != NULL ?
					 errdetail("Column %d should be \"%s\" of type %s.", i + 1,
							   column->name, format_type_be(column->type)) :
					 errdetail("It has more than %d columns.", def->ncolumns),
					 errhint("Do not alter the extension's tables; reinstall the extension with DROP EXTENSION and CREATE EXTENSION.")));

		name = column->name;
		if (attr->attnotnull != column->not_null)
			REFUSE_UNDO(def,
				   psprintf(attr->attnotnull ?
							"Column \"%s\" was made NOT NULL, which the extension would not enforce." :
							"Column \"%s\" is no longer NOT NULL.", name),
				   psprintf("ALTER TABLE %s ALTER %s %s NOT NULL", qualified, name,
							attr->attnotnull ? "DROP" : "SET"));
		if (attr->attcollation != expected_collation(column))
			REFUSE_UNDO(def,
				   psprintf("Column \"%s\" has collation \"%s\", not \"%s\".", name,
							get_collation_name(attr->attcollation),
							get_collation_name(expected_collation(column))),
				   psprintf("ALTER TABLE %s ALTER %s TYPE %s COLLATE \"%s\"",
							qualified, name, format_type_be(column->type),
							get_collation_name(expected_collation(column))));
		if (attr->attidentity != '\0')
			REFUSE_UNDO(def, psprintf("Column \"%s\" is an identity column.", name),
				   psprintf("ALTER TABLE %s ALTER %s DROP IDENTITY", qualified, name));
		if (attr->attgenerated != '\0')
			REFUSE_UNDO(def, psprintf("Column \"%s\" is a generated column.", name),
				   psprintf("ALTER TABLE %s ALTER %s DROP EXPRESSION", qualified, name));
	}
	ReleaseTupleDesc(desc);
}

/*
 * The table's primary key index, InvalidOid if it has none: what the direct
 * path opens and the check compares with.  Never heap->rd_pkindex itself,
 * which a rebuild of the relcache entry leaves unset (see the top).
 */
Oid
idem_primary_key_index(Relation heap)
{
	return compat_primary_key_index(heap);
}

/* Are the primary key's columns these, with the default operator classes? */
static bool
primary_key_is(Relation index, const ExpectedTable *def, const AttrNumber *pkey_columns)
{
	for (int i = 0; i < def->npkey; i++)
	{
		const ExpectedColumn *column = &def->columns[pkey_columns[i] - 1];
		Oid			opclass = GetDefaultOpClass(column->type, BTREE_AM_OID);

		if (index->rd_index->indkey.values[i] != pkey_columns[i] ||
			index->rd_indcollation[i] != expected_collation(column) ||
			!OidIsValid(opclass) ||
			index->rd_opfamily[i] != get_opclass_family(opclass))
			return false;
	}
	return true;
}

/*
 * Its primary key, pkindex: a btree on exactly the expected columns, in that
 * order, with the default operator classes and the columns' collations,
 * nothing included, checked immediately.  The probes build their scan keys
 * from that, and a speculative insertion relies on it being the one arbiter.
 * (The index's own relcache entry, open here, is reloaded in place by an
 * invalidation, so its fields stay where they are.)  The outbox's, never
 * probed, may also have the column order of an earlier version
 * (pkey_columns_before).
 */
static void
check_primary_key(Oid pkindex, const ExpectedTable *def, const char *qualified)
{
	StringInfoData columns;
	char	   *restore;
	Relation	index;
	bool		ok;

	initStringInfo(&columns);
	for (int i = 0; i < def->npkey; i++)
		appendStringInfo(&columns, "%s%s", i > 0 ? ", " : "",
						 def->columns[def->pkey_columns[i] - 1].name);

	if (!OidIsValid(pkindex))
	{
		restore = psprintf("ALTER TABLE %s DROP CONSTRAINT IF EXISTS %s_pkey, ADD PRIMARY KEY (%s)",
						   qualified, def->name, columns.data);
		REFUSE_UNDO(def, "It has no primary key, or a deferrable one.", restore);
	}

	index = index_open(pkindex, AccessShareLock);
	ok = index->rd_rel->relam == BTREE_AM_OID &&
		index->rd_index->indnatts == def->npkey &&
		index->rd_index->indnkeyatts == def->npkey &&
		index->rd_index->indimmediate &&
		RelationGetIndexExpressions(index) == NIL &&
		RelationGetIndexPredicate(index) == NIL;
	if (ok)
		ok = primary_key_is(index, def, def->pkey_columns) ||
			(def->pkey_columns_before != NULL &&
			 primary_key_is(index, def, def->pkey_columns_before));
	if (!ok)
	{
		restore = psprintf("ALTER TABLE %s DROP CONSTRAINT %s, ADD PRIMARY KEY (%s)",
						   qualified, quote_identifier(RelationGetRelationName(index)),
						   columns.data);
		REFUSE_UNDO(def,
					psprintf("Its primary key \"%s\" is not PRIMARY KEY (%s), not deferrable, with the default operator classes.",
							 RelationGetRelationName(index), columns.data),
					restore);
	}
	index_close(index, AccessShareLock);
}

/*
 * Its constraints: its own CHECKs, its NOT NULLs (PostgreSQL 18 keeps them
 * in pg_constraint too; check_columns compared them) and its primary key,
 * the one on pkindex; no other CHECK, no foreign key, unique or exclusion
 * constraint, and no constraint trigger.
 */
static void
check_constraints(Relation heap, Oid pkindex, const ExpectedTable *def,
				  const char *qualified)
{
	Relation	catalog;
	ScanKeyData key;
	SysScanDesc scan;
	HeapTuple	tuple;
	int			nchecks = 0;
	/* a copy: opening pg_constraint may rebuild the entry, and its rd_rel */
	const char *relname = pstrdup(RelationGetRelationName(heap));
	/* a Citus shard, "keys_102008", may name its constraints "..._102008" */
	const char *suffix = strncmp(relname, def->name, strlen(def->name)) == 0 ?
		relname + strlen(def->name) : "";

	catalog = table_open(ConstraintRelationId, AccessShareLock);
	ScanKeyInit(&key, Anum_pg_constraint_conrelid, BTEqualStrategyNumber,
				F_OIDEQ, ObjectIdGetDatum(RelationGetRelid(heap)));
	scan = systable_beginscan(catalog, ConstraintRelidTypidNameIndexId, true,
							  NULL, 1, &key);
	while (HeapTupleIsValid(tuple = systable_getnext(scan)))
	{
		Form_pg_constraint con = (Form_pg_constraint) GETSTRUCT(tuple);
		const char *name = NameStr(con->conname);
		bool		ours = false;

		switch (con->contype)
		{
			case CONSTRAINT_PRIMARY:
				ours = con->conindid == pkindex;
				break;
			case CONSTRAINT_CHECK:
				for (const char *const *check = def->checks; *check != NULL; check++)
					ours |= strncmp(name, *check, strlen(*check)) == 0 &&
						(name[strlen(*check)] == '\0' ||
						 strcmp(name + strlen(*check), suffix) == 0);
				nchecks += ours;
				break;
			default:
				/* NOT NULL (18), which check_columns compared */
				ours = con->contype == 'n';
				break;
		}
		if (!ours)
			REFUSE_UNDO(def,
				   psprintf(con->contype == CONSTRAINT_FOREIGN ?
							"It has foreign key constraint \"%s\", which the extension would not enforce." :
							"It has constraint \"%s\", which the extension would not enforce.",
							name),
				   psprintf("ALTER TABLE %s DROP CONSTRAINT %s", qualified,
							quote_identifier(name)));
	}
	systable_endscan(scan);
	table_close(catalog, AccessShareLock);

	for (const char *const *check = def->checks; *check != NULL; check++)
		nchecks--;
	if (nchecks != 0)
		REFUSE(def, "One of its CHECK constraints was dropped.",
			   "Reinstall the extension with DROP EXTENSION and CREATE EXTENSION.");
}

static char *
qualified_name(Oid relid)
{
	return quote_qualified_identifier(get_namespace_name(get_rel_namespace(relid)),
									  get_rel_name(relid));
}

/*
 * Its triggers: none.  Rows written by the direct path would not fire
 * them; a foreign key that references the table works by triggers on it,
 * so this also finds those.  What the message needs of the first trigger
 * is copied before the lookups that build it: they may rebuild the relcache
 * entry, whose old trigdesc is freed then.
 */
static void
check_triggers(Relation heap, const ExpectedTable *def, const char *qualified)
{
	Trigger    *trigger;
	char	   *name;
	Oid			constraint_oid;
	Oid			constraint_relid;

	if (heap->trigdesc == NULL || heap->trigdesc->numtriggers == 0)
		return;

	trigger = &heap->trigdesc->triggers[0];
	name = pstrdup(trigger->tgname);
	constraint_oid = trigger->tgconstraint;
	constraint_relid = trigger->tgconstrrelid;
	if (OidIsValid(constraint_oid))
	{
		/* a constraint's: a foreign key, here or elsewhere, or a deferred check */
		char	   *constraint = get_constraint_name(constraint_oid);
		Oid			owner = OidIsValid(constraint_relid) ?
			constraint_relid : RelationGetRelid(heap);

		REFUSE_UNDO(def,
					psprintf("Constraint \"%s\" of table %s works by triggers on it, which the extension's writes would not fire.",
							 constraint, qualified_name(owner)),
					psprintf("ALTER TABLE %s DROP CONSTRAINT %s", qualified_name(owner),
							 quote_identifier(constraint)));
	}
	REFUSE_UNDO(def,
				psprintf("It has trigger \"%s\", which the extension's writes would not fire.",
						 name),
				psprintf("DROP TRIGGER %s ON %s", quote_identifier(name), qualified));
}

/* The first parent of a table in an inheritance tree, or InvalidOid. */
static Oid
inheritance_parent(Oid relid)
{
	Relation	catalog;
	ScanKeyData key;
	SysScanDesc scan;
	HeapTuple	tuple;
	Oid			parent = InvalidOid;

	catalog = table_open(InheritsRelationId, AccessShareLock);
	ScanKeyInit(&key, Anum_pg_inherits_inhrelid, BTEqualStrategyNumber,
				F_OIDEQ, ObjectIdGetDatum(relid));
	scan = systable_beginscan(catalog, InheritsRelidSeqnoIndexId, true, NULL, 1, &key);
	if (HeapTupleIsValid(tuple = systable_getnext(scan)))
		parent = ((Form_pg_inherits) GETSTRUCT(tuple))->inhparent;
	systable_endscan(scan);
	table_close(catalog, AccessShareLock);
	return parent;
}

/*
 * Refuse the table, with an ERROR saying what is wrong and how to undo it,
 * unless it is exactly what the direct path was built for (see the top of
 * this file).
 */
void
idem_check_table(Relation heap, const ExpectedTable *def)
{
	Oid			relid = RelationGetRelid(heap);
	char	   *qualified = psprintf("%s.%s", IDEM_SCHEMA, def->name);
	Oid			pkindex;
	Oid			other;
	List	   *children;

	check_columns(heap, def, qualified);

	if (heap->rd_rel->relkind != RELKIND_RELATION)
		REFUSE(def, "It is not a plain table.",
			   "Reinstall the extension with DROP EXTENSION and CREATE EXTENSION.");
	if (heap->rd_rel->relispartition)
		REFUSE_UNDO(def, "It is a partition of another table.",
			   psprintf("ALTER TABLE %s DETACH PARTITION %s",
						qualified_name(get_partition_parent(relid, false)), qualified));
	if (heap->rd_rel->relam != HEAP_TABLE_AM_OID)
		REFUSE_UNDO(def, psprintf("It uses table access method \"%s\".",
							 get_am_name(heap->rd_rel->relam)),
			   psprintf("ALTER TABLE %s SET ACCESS METHOD heap", qualified));

	pkindex = idem_primary_key_index(heap);
	check_primary_key(pkindex, def, qualified);
	check_constraints(heap, pkindex, def, qualified);
	check_triggers(heap, def, qualified);

	if (heap->rd_rules != NULL && heap->rd_rules->numLocks > 0)
		REFUSE(def, "It has rules, which the extension's writes would not apply.",
			   psprintf("Drop them with DROP RULE ... ON %s (pg_rules lists them).", qualified));
	if (heap->rd_rel->relrowsecurity)
		REFUSE_UNDO(def, "Row-level security is enabled on it, which the extension would bypass.",
			   psprintf("ALTER TABLE %s DISABLE ROW LEVEL SECURITY", qualified));

	other = inheritance_parent(relid);
	if (OidIsValid(other))
		REFUSE_UNDO(def, psprintf("It inherits from table %s.", qualified_name(other)),
			   psprintf("ALTER TABLE %s NO INHERIT %s", qualified, qualified_name(other)));
	children = find_inheritance_children(relid, NoLock);
	if (children != NIL)
		REFUSE_UNDO(def, psprintf("Table %s inherits from it.", qualified_name(linitial_oid(children))),
			   psprintf("ALTER TABLE %s NO INHERIT %s", qualified_name(linitial_oid(children)),
						qualified));

	/*
	 * Hash distribution is handled by the caller (tables.c opens the shard,
	 * shards.c), which never passes the shell here; any other kind of Citus
	 * table (a reference or Citus local table, range or append
	 * distribution) keeps its rows elsewhere than the direct path looks.
	 */
	if (idem_table_distribution(relid) != IDEM_DIST_LOCAL)
		refuse(def, ERRCODE_FEATURE_NOT_SUPPORTED,
			   "The cluster distributes it other than by hash (a reference table, a table local to the coordinator, or range distribution), and idempotency reads and writes a distributed table only in the shard that holds a distribution value.",
			   psprintf("Distribute the extension's tables with SELECT idempotency.idem_distribute(), or undo it with SELECT undistribute_table('%s').",
						qualified));
}
