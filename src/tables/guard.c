/*-------------------------------------------------------------------------
 *
 * guard.c
 *	  Refusing, when it is run, the DDL that would break what the direct
 *	  path relies on.
 *
 * idem_check_table (table_check.c) refuses a table that was altered in a way
 * the direct path cannot honour, when the functions next open it.  On a
 * server that preloads the library, the utility hook calls this first, so
 * that the statement itself fails — and nothing is left half-changed for the
 * operator to undo.  What the direct path honours stays allowed: storage
 * parameters, SET LOGGED / UNLOGGED, statistics targets, storage and
 * compression, tablespaces, CLUSTER ON, replica identity, owners, and
 * non-unique indexes on columns.  VACUUM, ANALYZE, REINDEX, CLUSTER,
 * TRUNCATE, COPY and GRANT are not DDL on the table's definition and are
 * never looked at.  The extension's own scripts (CREATE / ALTER EXTENSION)
 * are not guarded, nor are tables of the same names that are not the
 * extension's (the SQL edition's, in a database without the extension).
 *
 * May call: the catalogs (namespace lookups, pg_extension).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/namespace.h"
#include "catalog/pg_class.h"
#include "catalog/pg_proc.h"
#include "catalog/dependency.h"
#include "commands/extension.h"
#include "miscadmin.h"
#include "nodes/parsenodes.h"
#include "parser/parse_func.h"
#include "utils/formatting.h"
#include "utils/lsyscache.h"

#include "tables/guard.h"

#define IDEM_SCHEMA "idempotency"

/* The tables the direct path writes. */
static const char *const guarded_tables[] = {"keys", "processed_events", "outbox"};

/* The guarded table that rv names, or NULL. */
static const char *
guarded_table(const RangeVar *rv)
{
	Oid			relid;
	Oid			schema;
	Oid			extension;

	if (rv == NULL)
		return NULL;
	/* a name that does not say its schema may still find ours on the path */
	if (rv->schemaname != NULL && strcmp(rv->schemaname, IDEM_SCHEMA) != 0)
		return NULL;
	schema = get_namespace_oid(IDEM_SCHEMA, true);
	if (!OidIsValid(schema))
		return NULL;
	relid = RangeVarGetRelid(rv, NoLock, true);
	if (!OidIsValid(relid) || get_rel_namespace(relid) != schema)
		return NULL;
	/*
	 * Only the extension's own tables: in a database without it, schema
	 * "idempotency" may hold the SQL edition's (installed by a script),
	 * whose writes go through the executor
	 */
	extension = get_extension_oid("idempotency", true);
	if (!OidIsValid(extension) ||
		getExtensionOfObject(RelationRelationId, relid) != extension)
		return NULL;
	for (size_t i = 0; i < lengthof(guarded_tables); i++)
		if (strcmp(get_rel_name(relid), guarded_tables[i]) == 0)
			return guarded_tables[i];
	return NULL;
}

static void
refuse(const char *table, const char *what)
{
	ereport(ERROR,
			(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
			 errmsg("idempotency does not support this change to table \"%s.%s\"",
					IDEM_SCHEMA, table),
			 errdetail("%s", what),
			 errhint("The extension writes its tables without the executor. It allows storage parameters, SET LOGGED or UNLOGGED, statistics, storage, compression, tablespace, CLUSTER ON, replica identity, owner, and non-unique indexes on columns.")));
}

/* A foreign key among these constraints that references a guarded table. */
static void
check_foreign_keys(List *constraints)
{
	ListCell   *lc;

	foreach(lc, constraints)
	{
		Constraint *con = lfirst(lc);
		const char *table;

		if (IsA(con, Constraint) && con->contype == CONSTR_FOREIGN &&
			(table = guarded_table(con->pktable)) != NULL)
			refuse(table, "A foreign key referencing it would not be enforced by the extension's writes.");
	}
}

/* The constraints of a table's elements, columns' included. */
static void
check_table_elements(List *elements)
{
	ListCell   *lc;

	foreach(lc, elements)
	{
		Node	   *element = lfirst(lc);

		if (IsA(element, ColumnDef))
			check_foreign_keys(((ColumnDef *) element)->constraints);
		else if (IsA(element, Constraint))
			check_foreign_keys(list_make1(element));
	}
}

/*
 * ALTER TABLE: on a guarded table, only the subcommands the direct path
 * honours; on any table, none that ties it to a guarded one.
 */
static void
check_alter_table(AlterTableStmt *stmt)
{
	const char *table = guarded_table(stmt->relation);
	ListCell   *lc;

	foreach(lc, stmt->cmds)
	{
		AlterTableCmd *cmd = lfirst(lc);

		if (table != NULL)
		{
			switch (cmd->subtype)
			{
				case AT_SetRelOptions:
				case AT_ResetRelOptions:
				case AT_ReplaceRelOptions:
				case AT_SetLogged:
				case AT_SetUnLogged:
				case AT_SetStatistics:
				case AT_SetStorage:
				case AT_SetCompression:
				case AT_SetTableSpace:
				case AT_ClusterOn:
				case AT_DropCluster:
				case AT_ReplicaIdentity:
				case AT_ChangeOwner:
				case AT_ValidateConstraint:
					break;
				case AT_EnableRowSecurity:
				case AT_ForceRowSecurity:
					refuse(table, "The extension's writes would bypass row-level security.");
					break;
				case AT_AddConstraint:
					refuse(table, "The extension's writes would not enforce a constraint added to it.");
					break;
				case AT_AlterColumnType:
				case AT_DropNotNull:
				case AT_SetNotNull:
					refuse(table, "The extension writes its columns as its script defines them.");
					break;
				default:
					refuse(table, "The extension's writes depend on the table's definition as its script created it.");
					break;
			}
		}
		else if (cmd->subtype == AT_AddConstraint)
			check_foreign_keys(list_make1(cmd->def));
		else if (cmd->subtype == AT_AddColumn && IsA(cmd->def, ColumnDef))
			check_foreign_keys(((ColumnDef *) cmd->def)->constraints);
		else if (cmd->subtype == AT_AddInherit)
		{
			const char *parent = guarded_table((RangeVar *) cmd->def);

			if (parent != NULL)
				refuse(parent, "Rows of a table inheriting from it would be invisible to the extension.");
		}
		else if (cmd->subtype == AT_AttachPartition)
		{
			const char *partition = guarded_table(((PartitionCmd *) cmd->def)->name);

			if (partition != NULL)
				refuse(partition, "The extension's tables cannot be partitions.");
		}
	}
}

/*
 * ALTER FUNCTION on one of the extension's functions: only its cost, rows
 * estimate, settings and strictness (a STRICT function is not called with
 * a NULL argument: the executor answers NULL).  Made PARALLEL SAFE, SECURITY DEFINER,
 * LEAKPROOF or of another volatility, a function would be called where its
 * code cannot run, or run with rights it must not have.
 */
static void
check_alter_function(AlterFunctionStmt *stmt)
{
	Oid			function = LookupFuncWithArgs(stmt->objtype, stmt->func, true);
	Oid			extension = get_extension_oid("idempotency", true);
	ListCell   *lc;

	if (!OidIsValid(function) || !OidIsValid(extension) ||
		getExtensionOfObject(ProcedureRelationId, function) != extension)
		return;
	foreach(lc, stmt->actions)
	{
		DefElem    *action = lfirst(lc);

		if (strcmp(action->defname, "cost") != 0 &&
			strcmp(action->defname, "rows") != 0 &&
			strcmp(action->defname, "strict") != 0 &&
			strcmp(action->defname, "set") != 0)
			ereport(ERROR,
					(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
					 errmsg("idempotency does not support changing %s of function %s",
							asc_toupper(action->defname, strlen(action->defname)),
							get_func_name(function)),
					 errhint("Only the cost, rows estimate, settings and strictness of the extension's functions can be changed.")));
	}
}

/*
 * DROP EXTENSION idempotency from inside a restricted operation: a route's
 * function, which the worker calls with the outbox row it publishes still to
 * be marked (outbox/publish.c would refuse the attempt afterwards; refusing here
 * spares the drop's locks on every table of the extension meanwhile).
 */
static void
check_drop_extension(DropStmt *stmt)
{
	ListCell   *lc;

	if (stmt->removeType != OBJECT_EXTENSION || !InSecurityRestrictedOperation())
		return;
	foreach(lc, stmt->objects)
		if (strcmp(strVal(lfirst(lc)), "idempotency") == 0)
			ereport(ERROR,
					(errcode(ERRCODE_INSUFFICIENT_PRIVILEGE),
					 errmsg("cannot drop extension \"idempotency\" during a restricted operation"),
					 errdetail("A route's function runs as one, while the worker publishes a row of the outbox.")));
}

void
idem_guard_utility(Node *statement)
{
	const char *table = NULL;

	/* the extension's own scripts define the tables */
	if (creating_extension)
		return;

	switch (nodeTag(statement))
	{
		case T_AlterTableStmt:
			check_alter_table((AlterTableStmt *) statement);
			break;
		case T_CreateStmt:
			{
				CreateStmt *stmt = (CreateStmt *) statement;
				ListCell   *lc;

				check_table_elements(stmt->tableElts);
				check_foreign_keys(stmt->constraints);
				foreach(lc, stmt->inhRelations)
					if ((table = guarded_table(lfirst(lc))) != NULL)
						refuse(table, "Rows of a table inheriting from it would be invisible to the extension.");
			}
			break;
		case T_CreateTrigStmt:
			if ((table = guarded_table(((CreateTrigStmt *) statement)->relation)) != NULL)
				refuse(table, "The extension's writes would not fire a trigger.");
			break;
		case T_CreatePolicyStmt:
			if ((table = guarded_table(((CreatePolicyStmt *) statement)->table)) != NULL)
				refuse(table, "The extension's writes would bypass row-level security.");
			break;
		case T_RuleStmt:
			if ((table = guarded_table(((RuleStmt *) statement)->relation)) != NULL)
				refuse(table, "The extension's writes would not apply a rule.");
			break;
		case T_IndexStmt:
			{
				IndexStmt  *stmt = (IndexStmt *) statement;
				ListCell   *lc;

				if ((table = guarded_table(stmt->relation)) == NULL)
					break;
				if (stmt->unique || stmt->primary || stmt->excludeOpNames != NIL)
					refuse(table, "The extension checks no uniqueness but its primary key's.");
				foreach(lc, stmt->indexParams)
					if (((IndexElem *) lfirst(lc))->expr != NULL)
						refuse(table, "The extension maintains indexes on columns only, not on expressions.");
			}
			break;
		case T_RenameStmt:
			{
				RenameStmt *stmt = (RenameStmt *) statement;

				if ((stmt->renameType == OBJECT_TABLE ||
					 stmt->renameType == OBJECT_COLUMN ||
					 stmt->renameType == OBJECT_TABCONSTRAINT) &&
					(table = guarded_table(stmt->relation)) != NULL)
					refuse(table, "The extension finds its tables, columns and constraints by name.");
			}
			break;
		case T_AlterObjectSchemaStmt:
			{
				AlterObjectSchemaStmt *stmt = (AlterObjectSchemaStmt *) statement;

				if (stmt->objectType == OBJECT_TABLE &&
					(table = guarded_table(stmt->relation)) != NULL)
					refuse(table, "The extension finds its tables in schema \"" IDEM_SCHEMA "\".");
			}
			break;
		case T_AlterFunctionStmt:
			check_alter_function((AlterFunctionStmt *) statement);
			break;
		case T_DropStmt:
			check_drop_extension((DropStmt *) statement);
			break;
		default:
			break;
	}
}
