/*-------------------------------------------------------------------------
 *
 * claim_scan.c
 *	  A direct scan of idem_claim(...) called in FROM.
 *
 * The usual call, SELECT ... FROM idempotency.idem_claim(...), is planned
 * as a Function Scan: the executor looks up the function's result type,
 * calls the function, which forms a composite datum, puts that into a
 * tuplestore, and reads it back out of it.  For a replay, which is one
 * index probe, that machinery costs about a tenth of the statement.  So the
 * planner is given a Custom Scan instead, which evaluates the arguments,
 * runs the same code as the function (idem_claim_columns) and hands its
 * columns to the executor as they are.
 *
 * It replaces the Function Scan only where nothing can tell the two apart:
 * our C function itself (not a wrapper, not one made SECURITY DEFINER or
 * given SET options, which would have to run through fmgr), called alone
 * in its FROM item (no WITH ORDINALITY, no ROWS FROM), with no reference to
 * the whole row and no SubPlan in its arguments, in a query that is a
 * plain SELECT all the way up (no row locks, no data-modifying WITH, not
 * inside an INSERT, UPDATE, DELETE or MERGE), so that EvalPlanQual never
 * has to run it again.  (It can still sit in a WITH query of a statement
 * whose outer part locks rows; EvalPlanQual then sets up its node again, but
 * a CTE Scan rechecked there reads the CTE's rows already made, and never
 * runs it.)  The scan checks
 * EXECUTE on the function, as the executor would, and the plan depends on
 * the function, so that ALTER FUNCTION replans.  EXPLAIN shows
 * "Custom Scan (idem_claim)", and with VERBOSE the call.
 *
 * One library serves databases at version 1.0 and 1.1 of the SQL objects:
 * the function is recognised by its C entry point, whichever of its two
 * signatures the database declares (five arguments at 1.0, six from 1.1
 * on), and the scan fills the columns of the claim_result type the database
 * declares (7 or 9).
 *
 * Owns: the planner hook and the Custom Scan node.
 * May call: keys/keys.h (idem_claim's columns), compat.h.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/detoast.h"
#include "access/sysattr.h"
#include "catalog/objectaccess.h"
#include "catalog/pg_language.h"
#include "catalog/pg_proc.h"
#include "catalog/pg_type.h"
#include "commands/explain.h"
#include "executor/executor.h"
#include "miscadmin.h"
#include "nodes/extensible.h"
#include "nodes/makefuncs.h"
#include "nodes/nodeFuncs.h"
#include "optimizer/pathnode.h"
#include "optimizer/paths.h"
#include "optimizer/clauses.h"
#include "optimizer/optimizer.h"
#include "optimizer/restrictinfo.h"
#include "parser/parsetree.h"
#include "utils/acl.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/ruleutils.h"
#include "utils/syscache.h"
#include "utils/typcache.h"

#include "keys/claim_scan.h"
#include "keys/keys.h"
#include "compat.h"
#include "infra/guc.h"

#define CLAIM_SCAN_NAME "idem_claim"

/*
 * The scan's state.  Its one row stays in values and nulls, in memory of
 * its own, until the arguments change: a rescan that changes none of them
 * (the inner side of a join, say) returns the same row again without a
 * second claim, as a Function Scan rereads its tuplestore.
 */
typedef struct ClaimScanState
{
	CustomScanState css;
	int			nargs;			/* 5 at version 1.0, 6 from 1.1 on */
	ExprState  *args[IDEM_CLAIM_MAX_NARGS]; /* each argument, NULL where a
											 * constant */
	int			ncolumns;		/* the scan tuple's columns ... */
	int			columns[IDEM_CLAIM_RESULT_NATTS];	/* ... in claim_result */
	Bitmapset  *arg_params;		/* the PARAM_EXEC ids the arguments read */
	FunctionCallInfo fcinfo;	/* the arguments, as idem_claim_columns reads them */
	MemoryContext row_context;	/* holds the row and all that made it */
	bool		have_row;		/* values and nulls hold the claim's answer */
	int			position;		/* 0 before the row, 1 on it, 2 past it */
	Datum		values[IDEM_CLAIM_RESULT_NATTS];
	bool		nulls[IDEM_CLAIM_RESULT_NATTS];
} ClaimScanState;

static set_rel_pathlist_hook_type prev_set_rel_pathlist_hook = NULL;

static Plan *claim_plan_path(PlannerInfo *root, RelOptInfo *rel,
							 CustomPath *best_path, List *tlist,
							 List *clauses, List *custom_plans);
static Node *claim_create_state(CustomScan *cscan);
static void claim_begin(CustomScanState *node, EState *estate, int eflags);
static TupleTableSlot *claim_exec(CustomScanState *node);
static void claim_end(CustomScanState *node);
static void claim_rescan(CustomScanState *node);
static void claim_explain(CustomScanState *node, List *ancestors,
						  ExplainState *es);

static const CustomPathMethods claim_path_methods = {
	.CustomName = CLAIM_SCAN_NAME,
	.PlanCustomPath = claim_plan_path,
};

static const CustomScanMethods claim_scan_methods = {
	.CustomName = CLAIM_SCAN_NAME,
	.CreateCustomScanState = claim_create_state,
};

static const CustomExecMethods claim_exec_methods = {
	.CustomName = CLAIM_SCAN_NAME,
	.BeginCustomScan = claim_begin,
	.ExecCustomScan = claim_exec,
	.EndCustomScan = claim_end,
	.ReScanCustomScan = claim_rescan,
	.ExplainCustomScan = claim_explain,
};

/*
 * Is funcid our idem_claim, called as plainly as fmgr would call it?  fmgr
 * puts its own wrapper in front of a SECURITY DEFINER function, one with SET
 * options, or one a security hook watches: then fn_addr is not idem_claim.
 * Nor may it have been made STRICT.
 */
static bool
is_plain_idem_claim(Oid funcid)
{
	HeapTuple	proc = SearchSysCache1(PROCOID, ObjectIdGetDatum(funcid));
	FmgrInfo	flinfo;
	bool		plain;

	if (!HeapTupleIsValid(proc))
		return false;
	/* STRICT would have the executor skip calls with a NULL argument */
	plain = ((Form_pg_proc) GETSTRUCT(proc))->prolang == ClanguageId &&
		!((Form_pg_proc) GETSTRUCT(proc))->proisstrict;
	ReleaseSysCache(proc);
	if (!plain)
		return false;
	fmgr_info(funcid, &flinfo);
	return flinfo.fn_addr == idem_claim;
}

/* A plain SELECT at every level of the query this rel belongs to? */
static bool
in_plain_select(PlannerInfo *root)
{
	for (PlannerInfo *level = root; level != NULL; level = level->parent_root)
	{
		Query	   *parse = level->parse;

		if (parse->commandType != CMD_SELECT || parse->rowMarks != NIL ||
			parse->hasModifyingCTE)
			return false;
	}
	return true;
}

/*
 * Does anything read the rel's row as a whole: its target list, its own
 * conditions, or the join conditions a parameterized scan would take in?
 */
static bool
references_whole_row(RelOptInfo *rel)
{
	Bitmapset  *attnos = NULL;
	ListCell   *lc;

	pull_varattnos((Node *) rel->reltarget->exprs, rel->relid, &attnos);
	foreach(lc, rel->baserestrictinfo)
		pull_varattnos((Node *) lfirst_node(RestrictInfo, lc)->clause, rel->relid, &attnos);
	foreach(lc, rel->joininfo)
		pull_varattnos((Node *) lfirst_node(RestrictInfo, lc)->clause, rel->relid, &attnos);
	return bms_is_member(InvalidAttrNumber - FirstLowInvalidHeapAttributeNumber, attnos);
}

/*
 * Does claim_result have the columns this code fills, as version 1.0 or
 * 1.1 declares it?  (Otherwise the function reports what is wrong.)
 */
static bool
result_type_is_ours(Oid typid)
{
	TupleDesc	desc = lookup_rowtype_tupdesc_noerror(typid, -1, true);
	bool		ours;

	if (desc == NULL)
		return false;
	ours = idem_claim_result_natts(desc) > 0;
	ReleaseTupleDesc(desc);
	return ours;
}

/*
 * set_rel_pathlist_hook: swap the Function Scan of a plain idem_claim call
 * for ours, at the same cost and with the same parameterization (a LATERAL
 * call is parameterized by the rels its arguments reference).
 */
static void
claim_set_rel_pathlist(PlannerInfo *root, RelOptInfo *rel, Index rti,
					   RangeTblEntry *rte)
{
	RangeTblFunction *rtfunc;
	FuncExpr   *fexpr;
	Path	   *function_path;
	CustomPath *cpath;

	if (prev_set_rel_pathlist_hook)
		prev_set_rel_pathlist_hook(root, rel, rti, rte);

	if (!idem_direct_paths)
		return;
	if (rte->rtekind != RTE_FUNCTION || rte->funcordinality ||
		list_length(rte->functions) != 1 || rel->reloptkind != RELOPT_BASEREL)
		return;
	rtfunc = linitial_node(RangeTblFunction, rte->functions);
	if (!IsA(rtfunc->funcexpr, FuncExpr) || rtfunc->funccolnames != NIL)
		return;
	fexpr = (FuncExpr *) rtfunc->funcexpr;
	/* the planner has filled in the defaults: 1.0's five arguments, or six */
	if (fexpr->funcretset ||
		list_length(fexpr->args) < IDEM_CLAIM_MIN_NARGS ||
		list_length(fexpr->args) > IDEM_CLAIM_MAX_NARGS)
		return;
	/* a SubPlan's outer references would escape the rescan check below */
	if (contain_subplans((Node *) fexpr))
		return;

	/* exactly the one Function Scan path the core planner made */
	if (list_length(rel->pathlist) != 1 || rel->partial_pathlist != NIL)
		return;
	function_path = linitial(rel->pathlist);
	if (function_path->pathtype != T_FunctionScan)
		return;

	/* a whole-row reference would need the composite datum itself */
	if (references_whole_row(rel))
		return;

	if (!in_plain_select(root) || !is_plain_idem_claim(fexpr->funcid) ||
		!result_type_is_ours(fexpr->funcresulttype))
		return;

	cpath = makeNode(CustomPath);
	cpath->path.pathtype = T_CustomScan;
	cpath->path.parent = rel;
	cpath->path.pathtarget = function_path->pathtarget;
	cpath->path.param_info = function_path->param_info;
	cpath->path.rows = function_path->rows;
	cpath->path.startup_cost = function_path->startup_cost;
	cpath->path.total_cost = function_path->total_cost;
	cpath->path.pathkeys = NIL;
	cpath->flags = CUSTOMPATH_SUPPORT_BACKWARD_SCAN;
	cpath->methods = &claim_path_methods;

	rel->pathlist = list_make1(cpath);
}

/*
 * The plan: the scan tuple is the columns of claim_result that the plan
 * reads (custom_scan_tlist, Vars of the function's rel; custom_private
 * holds those columns' numbers in claim_result).  The call itself is the
 * one custom expression, so that setrefs and nestloop parameters treat its
 * arguments as they would a Function Scan's, and EXPLAIN can show it.
 */
static Plan *
claim_plan_path(PlannerInfo *root, RelOptInfo *rel, CustomPath *best_path,
				List *tlist, List *clauses, List *custom_plans)
{
	RangeTblEntry *rte = planner_rt_fetch(rel->relid, root);
	RangeTblFunction *rtfunc = linitial_node(RangeTblFunction, rte->functions);
	FuncExpr   *fexpr = castNode(FuncExpr, rtfunc->funcexpr);
	CustomScan *cscan = makeNode(CustomScan);
	TupleDesc	desc = lookup_rowtype_tupdesc(fexpr->funcresulttype, -1);
	List	   *quals = extract_actual_clauses(clauses, false);
	Bitmapset  *needed = NULL;
	List	   *scan_tlist = NIL;
	List	   *columns = NIL;

	/* the scan tuple holds only the columns the plan reads */
	pull_varattnos((Node *) tlist, rel->relid, &needed);
	pull_varattnos((Node *) quals, rel->relid, &needed);
	for (int i = 0; i < desc->natts; i++)
	{
		Form_pg_attribute attr = TupleDescAttr(desc, i);
		Var		   *var;

		if (!bms_is_member(i + 1 - FirstLowInvalidHeapAttributeNumber, needed))
			continue;
		var = makeVar(rel->relid, i + 1, attr->atttypid, attr->atttypmod,
					  attr->attcollation, 0);
		scan_tlist = lappend(scan_tlist,
							 makeTargetEntry((Expr *) var, list_length(scan_tlist) + 1,
											 NULL, false));
		columns = lappend_int(columns, i);
	}
	ReleaseTupleDesc(desc);

	cscan->scan.plan.targetlist = tlist;
	cscan->scan.plan.qual = quals;
	cscan->scan.scanrelid = 0;
	cscan->flags = best_path->flags;
	cscan->custom_scan_tlist = scan_tlist;
	cscan->custom_exprs = list_make1(copyObject(fexpr));
	cscan->custom_private = columns;
	cscan->methods = &claim_scan_methods;

	/*
	 * setrefs records the plan's dependency on the function in custom_exprs,
	 * as for any call: ALTER FUNCTION (SECURITY DEFINER, SET ...) or DROP
	 * replans.
	 */
	return &cscan->scan.plan;
}

static Node *
claim_create_state(CustomScan *cscan)
{
	ClaimScanState *state = palloc0(sizeof(ClaimScanState));

	NodeSetTag(state, T_CustomScanState);
	state->css.methods = &claim_exec_methods;
	return (Node *) state;
}

/* The PARAM_EXEC ids an expression reads. */
static bool
collect_exec_params(Node *node, Bitmapset **params)
{
	if (node == NULL)
		return false;
	if (IsA(node, Param) && ((Param *) node)->paramkind == PARAM_EXEC)
		*params = bms_add_member(*params, ((Param *) node)->paramid);
	return expression_tree_walker(node, collect_exec_params, params);
}

/* What ExecInitFunc checks of a function the executor is about to call. */
static void
claim_begin(CustomScanState *node, EState *estate, int eflags)
{
	ClaimScanState *state = (ClaimScanState *) node;
	CustomScan *cscan = castNode(CustomScan, node->ss.ps.plan);
	FuncExpr   *fexpr = linitial_node(FuncExpr, cscan->custom_exprs);
	Oid			funcid = fexpr->funcid;
	AclResult	aclresult;
	ListCell   *lc;

	aclresult = compat_function_aclcheck(funcid, GetUserId(), ACL_EXECUTE);
	if (aclresult != ACLCHECK_OK)
		aclcheck_error(aclresult, OBJECT_FUNCTION, get_func_name(funcid));
	InvokeFunctionExecuteHook(funcid);

	/* as many arguments as the database's idem_claim has (see keys.h) */
	state->nargs = list_length(fexpr->args);
	state->fcinfo = palloc0(SizeForFunctionCallInfo(state->nargs));
	InitFunctionCallInfoData(*state->fcinfo, NULL, state->nargs, InvalidOid,
							 NULL, NULL);
	/* constants (the defaults, usually) are set once; the rest evaluated */
	foreach(lc, fexpr->args)
	{
		int			i = foreach_current_index(lc);
		Expr	   *arg = (Expr *) lfirst(lc);

		if (IsA(arg, Const))
		{
			state->fcinfo->args[i].value = ((Const *) arg)->constvalue;
			state->fcinfo->args[i].isnull = ((Const *) arg)->constisnull;
		}
		else
			state->args[i] = ExecInitExpr(arg, &node->ss.ps);
	}
	collect_exec_params((Node *) cscan->custom_exprs, &state->arg_params);

	foreach(lc, cscan->custom_private)
		state->columns[state->ncolumns++] = lfirst_int(lc);
	state->row_context = AllocSetContextCreate(CurrentMemoryContext,
											   "idem_claim scan",
											   ALLOCSET_SMALL_SIZES);
}

/*
 * Evaluate the arguments and make the claim, in the row's memory context.
 * A column stored out of line is fetched now, as the composite datum the
 * function returns would have it.
 */
static void
claim_make_row(ClaimScanState *state)
{
	ExprContext *econtext = state->css.ss.ps.ps_ExprContext;
	FunctionCallInfo fcinfo = state->fcinfo;
	MemoryContext oldcxt;

	MemoryContextReset(state->row_context);
	oldcxt = MemoryContextSwitchTo(state->row_context);
	for (int i = 0; i < state->nargs; i++)
	{
		if (state->args[i] != NULL)
			fcinfo->args[i].value = ExecEvalExpr(state->args[i], econtext,
												 &fcinfo->args[i].isnull);
	}
	idem_claim_columns(fcinfo, state->values, state->nulls);
	for (int i = 0; i < IDEM_CLAIM_RESULT_NATTS; i++)
	{
		struct varlena *value = (struct varlena *) DatumGetPointer(state->values[i]);

		if (!state->nulls[i] && (idem_claim_result_types[i] == TEXTOID ||
								 idem_claim_result_types[i] == JSONBOID) &&
			VARATT_IS_EXTERNAL(value))
			state->values[i] = PointerGetDatum(detoast_external_attr(value));
	}
	MemoryContextSwitchTo(oldcxt);
	state->have_row = true;
}

/*
 * The one row, as a virtual tuple of the columns the plan reads, pointing
 * into the row's memory.  A cursor can move back over it, as over a
 * Function Scan's tuplestore: forward from before the row returns it, back
 * from past it returns it again, and any other move returns nothing.
 */
static TupleTableSlot *
claim_next(ScanState *ss)
{
	ClaimScanState *state = (ClaimScanState *) ss;
	TupleTableSlot *slot = ss->ss_ScanTupleSlot;

	bool		backward = ScanDirectionIsBackward(ss->ps.state->es_direction);
	bool		onto_row = state->position == (backward ? 2 : 0);

	ExecClearTuple(slot);
	state->position = onto_row ? 1 : backward ? 0 : 2;
	if (!onto_row)
		return slot;
	if (!state->have_row)
		claim_make_row(state);
	for (int i = 0; i < state->ncolumns; i++)
	{
		slot->tts_values[i] = state->values[state->columns[i]];
		slot->tts_isnull[i] = state->nulls[state->columns[i]];
	}
	return ExecStoreVirtualTuple(slot);
}

/* Never reached: the scan is planned only where EvalPlanQual cannot run. */
static bool
claim_recheck(ScanState *ss, TupleTableSlot *slot)
{
	elog(ERROR, "idem_claim's scan cannot be rechecked");
	return false;
}

static TupleTableSlot *
claim_exec(CustomScanState *node)
{
	return ExecScan(&node->ss, claim_next, claim_recheck);
}

static void
claim_end(CustomScanState *node)
{
	MemoryContextDelete(((ClaimScanState *) node)->row_context);
}

/*
 * A LATERAL call runs again when an outer row changes its arguments; any
 * other rescan returns the same row.
 */
static void
claim_rescan(CustomScanState *node)
{
	ClaimScanState *state = (ClaimScanState *) node;

	if (bms_overlap(node->ss.ps.chgParam, state->arg_params))
		state->have_row = false;
	state->position = 0;
	ExecScanReScan(&node->ss);
}

/* EXPLAIN VERBOSE shows the call, as it does a Function Scan's. */
static void
claim_explain(CustomScanState *node, List *ancestors, ExplainState *es)
{
	CustomScan *cscan = castNode(CustomScan, node->ss.ps.plan);
	List	   *context;

	if (!es->verbose)
		return;
	context = set_deparse_context_plan(es->deparse_cxt, &cscan->scan.plan, ancestors);
	ExplainPropertyText("Function Call",
						deparse_expression(linitial(cscan->custom_exprs), context,
										   list_length(es->rtable) > 1, false),
						es);
}

void
idem_claim_scan_register(void)
{
	RegisterCustomScanMethods(&claim_scan_methods);
	prev_set_rel_pathlist_hook = set_rel_pathlist_hook;
	set_rel_pathlist_hook = claim_set_rel_pathlist;
}
