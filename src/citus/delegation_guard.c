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
 * Owns: the planner hook.
 * May call: citus/shards.h (whether Citus delegates a function).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "catalog/namespace.h"
#include "nodes/nodeFuncs.h"
#include "optimizer/planner.h"
#include "utils/lsyscache.h"

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
			idem_citus_delegates_function(fn))
		{
			call->funcid = fn;
			return true;
		}
	}
	if (IsA(node, Query))
		return query_tree_walker((Query *) node, find_delegated_call, call, 0);
	return expression_tree_walker(node, find_delegated_call, call);
}

static PlannedStmt *
guard_planner(Query *parse, const char *query_string, int cursorOptions,
			  ParamListInfo boundParams)
{
	DelegatedCall call = {InvalidOid, InvalidOid};

	if (parse->commandType == CMD_SELECT && parse->utilityStmt == NULL &&
		has_subquery_or_with(parse) && !from_has_table(parse) &&
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
	if (prev_planner_hook)
		return prev_planner_hook(parse, query_string, cursorOptions, boundParams);
	return standard_planner(parse, query_string, cursorOptions, boundParams);
}

void
idem_delegation_guard_register(void)
{
	prev_planner_hook = planner_hook;
	planner_hook = guard_planner;
}
