/*-------------------------------------------------------------------------
 *
 * plan_settings.c
 *	  The planner settings a kept SPI statement runs under: the outbox's
 *	  statements (outbox/outbox_sql.c) and the events' batch look
 *	  (events/events.c).
 *
 * Owns: plan_cache_mode, the planner's enable_* settings and jit for the
 *	  length of one execution (the statement may be planned then).
 * May call: the server only.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "nodes/parsenodes.h"
#include "utils/guc.h"

#include "infra/plan_settings.h"

/*
 * The settings a walk_in_order statement is planned under, each "off" for
 * that statement only: what is left to read rows in an order is an index
 * scan (and nested loops over index scans to join), so a LIMIT stops the
 * walk, whatever the statistics say.  A way that is off is still taken
 * where nothing else can do (a sort of the batch's own rows), at the price
 * of a cost of 10^10 added for each such node, which puts the plan far
 * above jit_above_cost: so jit is off as well, or each batch of a few rows
 * would be compiled first (0.3 s, a measured wake-up to publish on 15,
 * against 5 ms).
 */
static const char *const walk_in_order_settings[] = {
	"enable_seqscan", "enable_bitmapscan", "enable_sort",
	"enable_hashjoin", "enable_mergejoin", "jit", NULL
};

/* The cursor options to prepare a statement of this mode with. */
int
idem_plan_cursor_options(IdemPlanMode mode)
{
	return mode == IDEM_PLAN_CUSTOM ? CURSOR_OPT_CUSTOM_PLAN :
		mode == IDEM_PLAN_GENERIC ? CURSOR_OPT_GENERIC_PLAN : 0;
}

static void
set_for_statement(const char *name, const char *value)
{
	(void) set_config_option(name, value, PGC_USERSET, PGC_S_SESSION,
							 GUC_ACTION_SAVE, true, 0, false);
}

/*
 * Enter the settings of a statement, for as long as it runs: whether
 * plancache.c plans it again is only known inside the run (an
 * invalidation may arrive as it takes its locks).  plan_cache_mode is set
 * too, since a session's (or a role's, or a database's) would win over
 * the cursor options.  Returns the GUC nest level to leave with
 * idem_plan_settings_end, or -1 where nothing was set.  An error in
 * between is cleaned up by the (sub)transaction's abort.
 */
int
idem_plan_settings_begin(IdemPlanMode mode, bool walk_in_order)
{
	int			guc_nest_level;

	if (mode == IDEM_PLAN_AUTO && !walk_in_order)
		return -1;
	guc_nest_level = NewGUCNestLevel();
	if (walk_in_order)
		for (int i = 0; walk_in_order_settings[i] != NULL; i++)
			set_for_statement(walk_in_order_settings[i], "off");
	set_for_statement("plan_cache_mode",
					  mode == IDEM_PLAN_GENERIC ? "force_generic_plan" :
					  mode == IDEM_PLAN_CUSTOM ? "force_custom_plan" : "auto");
	return guc_nest_level;
}

void
idem_plan_settings_end(int guc_nest_level)
{
	if (guc_nest_level >= 0)
		AtEOXact_GUC(false, guc_nest_level);
}
