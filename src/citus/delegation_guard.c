/*-------------------------------------------------------------------------
 *
 * delegation_guard.c
 *	  Refuses, before Citus plans it, a query from which Citus would delegate
 *	  one of the extension's functions and crash.
 *
 * Citus delegates a distributed function to the node of the shard that
 * holds its distribution argument when the call is the whole query: SELECT
 * f(...), or SELECT ... FROM f(...) with nothing else in FROM and no WHERE.
 * For a query that names no distributed table, its planner hook decides
 * that after standard_planner has run, on the Query the planner rewrote in
 * place, and deparses that Query to send it (TryToDelegateFunctionCall, in
 * Citus 13.2, and 14.0.1 on PostgreSQL 18).  Planning may
 * have pulled a subquery up into the query (a VALUES list or sub-SELECT in
 * FROM, a view, an inlined WITH query), leaving the call as the only FROM
 * item, so that Citus delegates it; but the pull-up left the subquery's
 * range table entry with no subquery (NULL), which Citus's deparser
 * dereferences while it takes the query's locks (AcquireRewriteLocks).  The
 * backend dies of SIGSEGV, and the postmaster restarts every session:
 *
 *	SELECT count(*) FROM idempotency.idem_claim('t1', 'k') c, (VALUES (1)) v;
 *
 * Any function Citus distributes does this.  This hook runs before Citus's
 * (our library comes after citus in shared_preload_libraries, which Citus
 * requires), and refuses with 0A000 a
 * query that calls one of the extension's functions that Citus delegates
 * when planning could leave it so: a SELECT with a subquery or a WITH query
 * and no table in its FROM or in the subqueries and WITH queries its FROM
 * names, at any depth (a table would stay in FROM beside the call, and
 * Citus would not delegate).  Such a query cannot be delegated as written;
 * undelegated, the call runs on the node the query reached, which works
 * only where the shard happens to be placed on that node (elsewhere it is
 * refused, 55000).  The refusal is a deliberate trade-off: where Citus
 * would not have delegated anyway (the shard is on the node the query
 * reached, as on a single-node cluster, or the query runs inside a
 * delegated function of the application's), the query would have worked
 * and is refused all the same, so that its answer never depends on where
 * the shard is placed.  A SQL function of the application's that the
 * planner inlines can still bring the shape in unseen (the original query
 * shows no subquery): doc/integrations/citus.md says so.
 *
 * What is checked first costs a walk of the query's range table, and the
 * catalogs are read only for a query with a subquery or WITH query that
 * calls a function of the schema idempotency.
 *
 * The hook also makes a delegated call follow a shard move.  Citus picks
 * the node of a delegated call while it plans, from its metadata, without
 * a lock, and sends the call there; a move that switched the placement
 * meanwhile left the call on the old node, which refused it (55000) once
 * the move's lock let it go on.  A router write does not fail so: Citus's
 * executor takes the shard's metadata lock (ShareLock) on the node that
 * runs the query before it reads the placement.  So, for a query that is
 * one call of a delegated function of ours (the shapes Citus delegates:
 * SELECT f(...), SELECT ... FROM f(...)) whose distribution argument is
 * known when it is planned (it folds to a constant, as Citus needs it to),
 * the hook takes that lock before Citus plans (citus/shards.c,
 * idem_lock_shard_for_call): a call planned during a move waits for it and
 * goes to the new node; a move that starts later waits for the call's
 * transaction, as for a router write.  The shape is checked first; the
 * catalogs are read only for a call of a function of the schema
 * idempotency.
 *
 * Owns: the planner hook, installed only where Citus is loaded
 *	  (idem_delegation_guard_register).
 * May call: citus/shards.h (whether Citus delegates a function, the
 *	  shard lock of a call).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/table.h"
#include "catalog/namespace.h"
#include "catalog/pg_type.h"
#include "nodes/nodeFuncs.h"
#include "optimizer/optimizer.h"
#include "optimizer/planner.h"
#include "nodes/pathnodes.h"
#include "parser/parsetree.h"
#include "utils/guc.h"
#include "utils/lsyscache.h"
#include "utils/rel.h"

#include "citus/delegation_guard.h"
#include "citus/shards.h"

static planner_hook_type prev_planner_hook = NULL;

/* Could planning pull a subquery up into the query: has it one, or a WITH? */
static bool
has_subquery_or_with(Query *query)
{
	ListCell   *lc;

	if (query->cteList != NIL)
		return true;
	foreach(lc, query->rtable)
	{
		if (lfirst_node(RangeTblEntry, lc)->rtekind == RTE_SUBQUERY)
			return true;
	}
	return false;
}

/*
 * Has FROM a table, in the query or in the subqueries and WITH queries its
 * FROM names?  Only what FROM names counts: Citus looks at the FROM of the
 * query as planned, where a WITH query that FROM does not name, or names
 * from an outer level, leaves nothing.  (A false answer only refuses more.)
 */
static bool
from_has_table(Query *query)
{
	ListCell   *lc;

	foreach(lc, query->rtable)
	{
		RangeTblEntry *rte = lfirst_node(RangeTblEntry, lc);

		if (!rte->inFromCl)
			continue;			/* (a view's query at 15 also lists itself, as OLD and NEW) */
		if (rte->rtekind == RTE_RELATION)
			return true;
		if (rte->rtekind == RTE_SUBQUERY && rte->subquery != NULL &&
			from_has_table(rte->subquery))
			return true;
		if (rte->rtekind == RTE_CTE && rte->ctelevelsup == 0)
		{
			ListCell   *lc2;

			foreach(lc2, query->cteList)
			{
				CommonTableExpr *cte = lfirst_node(CommonTableExpr, lc2);

				if (strcmp(cte->ctename, rte->ctename) == 0 &&
					IsA(cte->ctequery, Query) &&
					from_has_table((Query *) cte->ctequery))
					return true;
			}
		}
	}
	return false;
}

/* What find_delegated_call looks for, and what it found. */
typedef struct DelegatedCall
{
	Oid			schema;			/* the extension's schema */
	Oid			funcid;			/* the call found */
} DelegatedCall;

/*
 * Find a call of a function of the extension's schema that Citus
 * delegates, anywhere but in a SubLink (Citus delegates only a call that
 * is the whole query): call->funcid is set to it.
 */
static bool
find_delegated_call(Node *node, DelegatedCall *call)
{
	if (node == NULL || IsA(node, SubLink))
		return false;
	if (IsA(node, FuncExpr))
	{
		Oid			fn = ((FuncExpr *) node)->funcid;

		if (get_func_namespace(fn) == call->schema &&
			idem_function_delegated(fn))
		{
			call->funcid = fn;
			return true;
		}
	}
	if (IsA(node, Query))
		return query_tree_walker((Query *) node, find_delegated_call, call, 0);
	return expression_tree_walker(node, find_delegated_call, call);
}

/*
 * The call that is the whole query, in the shapes Citus delegates (its
 * TryToDelegateFunctionCall): SELECT f(...), or SELECT ... FROM f(...)
 * with nothing else in FROM and no WHERE; NULL for any other query.
 */
static FuncExpr *
whole_query_call(Query *query)
{
	FromExpr   *jointree = query->jointree;
	FuncExpr   *from_call = NULL;
	FuncExpr   *target_call = NULL;

	if (jointree == NULL || jointree->quals != NULL || list_length(jointree->fromlist) > 1)
		return NULL;
	if (jointree->fromlist != NIL)
	{
		Node	   *item = linitial(jointree->fromlist);
		RangeTblEntry *rte;
		Node	   *call;

		if (!IsA(item, RangeTblRef))
			return NULL;
		rte = rt_fetch(((RangeTblRef *) item)->rtindex, query->rtable);
		if (rte->rtekind != RTE_FUNCTION || list_length(rte->functions) != 1)
			return NULL;
		call = linitial_node(RangeTblFunction, rte->functions)->funcexpr;
		if (!IsA(call, FuncExpr))
			return NULL;
		from_call = (FuncExpr *) call;
	}
	if (list_length(query->targetList) == 1 &&
		IsA(linitial_node(TargetEntry, query->targetList)->expr, FuncExpr))
		target_call = (FuncExpr *) linitial_node(TargetEntry, query->targetList)->expr;
	if (from_call != NULL && target_call != NULL)
		return NULL;			/* SELECT f() FROM g(): Citus does not delegate */
	return from_call != NULL ? from_call : target_call;
}

/*
 * The value of a call's first argument (the one idem_distribute() makes
 * the distribution argument) when planning knows it: the argument folded
 * as standard_planner folds it before Citus looks at it (constants, the
 * parameters bound for a custom plan: Citus delegates a call with
 * parameters only once they are bound), if that leaves a text constant;
 * else NULL.
 */
static text *
first_argument(FuncExpr *call, ParamListInfo params)
{
	PlannerGlobal *glob;
	PlannerInfo *root;
	Node	   *arg;

	if (call->args == NIL)
		return NULL;
	glob = makeNode(PlannerGlobal);
	glob->boundParams = params;
	root = makeNode(PlannerInfo);
	root->glob = glob;
	arg = eval_const_expressions(root, (Node *) copyObject(linitial(call->args)));
	if (!IsA(arg, Const) || ((Const *) arg)->constisnull ||
		((Const *) arg)->consttype != TEXTOID)
		return NULL;
	return DatumGetTextPP(((Const *) arg)->constvalue);
}

/*
 * If the query is one call of a function of ours that Citus delegates,
 * with its distribution value known: lock that value's shard (see the top
 * of this file).  The extension's hash-distributed tables are colocated
 * with keys (idem_distribute), so keys names the shard group.
 */
static void
lock_shard_of_delegated_call(Query *parse, ParamListInfo params)
{
	FuncExpr   *call = whole_query_call(parse);
	Oid			schema;
	Oid			keys;
	text	   *value;
	Relation	shell;

	if (call == NULL ||
		!OidIsValid(schema = get_namespace_oid("idempotency", true)) ||
		get_func_namespace(call->funcid) != schema ||
		!idem_function_delegated(call->funcid) ||
		(value = first_argument(call, params)) == NULL ||
		!OidIsValid(keys = get_relname_relid("keys", schema)) ||
		idem_table_distribution(keys) != IDEM_DIST_HASH)
		return;
	shell = table_open(keys, AccessShareLock);
	idem_lock_shard_for_call(shell, value, psprintf("%s()", get_func_name(call->funcid)));
	table_close(shell, NoLock);
}

/*
 * Refuse the query if Citus would delegate one of our functions from it
 * and crash; else, if it is a delegated call of ours, lock its shard.
 */
static void
check_query(Query *parse, ParamListInfo boundParams)
{
	DelegatedCall call = {InvalidOid, InvalidOid};

	if (has_subquery_or_with(parse) && !from_has_table(parse) &&
		OidIsValid(call.schema = get_namespace_oid("idempotency", true)) &&
		find_delegated_call((Node *) parse, &call))
	{
		char	   *name = get_func_name(call.funcid);

		ereport(ERROR,
				(errcode(ERRCODE_FEATURE_NOT_SUPPORTED),
				 errmsg("%s() cannot be called beside a subquery, a VALUES list, a view or a WITH query when Citus distributes it",
						name),
				 errdetail("Citus would delegate the call from the query as its planner rewrote it, which Citus fails to deparse: the server process would crash."),
				 errhint("Call it as the whole query, SELECT ... FROM idempotency.%s(...), so that Citus runs it on the node of the shard, and run the rest as a statement of its own.",
						 name)));
	}
	lock_shard_of_delegated_call(parse, boundParams);
}

static PlannedStmt *
guard_planner(Query *parse, const char *query_string, int cursorOptions,
			  ParamListInfo boundParams)
{
	/* a database without Citus's metadata delegates nothing */
	if (parse->commandType == CMD_SELECT && parse->utilityStmt == NULL &&
		idem_cluster_metadata_exists())
		check_query(parse, boundParams);
	if (prev_planner_hook)
		return prev_planner_hook(parse, query_string, cursorOptions, boundParams);
	return standard_planner(parse, query_string, cursorOptions, boundParams);
}

/*
 * Is Citus loaded in this process: has it defined its setting citus.version
 * (not a placeholder that a configuration file made)?
 */
static bool
citus_loaded(void)
{
	return GetConfigOption("citus.version", true, false) != NULL &&
		!(GetConfigOptionFlags("citus.version", true) & GUC_CUSTOM_PLACEHOLDER);
}

/*
 * From _PG_init: install the hook, only where Citus is loaded.  Citus can
 * be loaded only through shared_preload_libraries, and it refuses to load
 * after a library that set a hook (as ours does when preloaded: the DDL
 * guard's): so Citus is either loaded already when this library is,
 * preloaded or not, or never in this process.  Where Citus is loaded but a
 * database has not its extension, the hook returns at once
 * (idem_cluster_metadata_exists, cached).
 */
void
idem_delegation_guard_register(void)
{
	if (!citus_loaded())
		return;
	prev_planner_hook = planner_hook;
	planner_hook = guard_planner;
}
