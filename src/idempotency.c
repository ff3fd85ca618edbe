/*-------------------------------------------------------------------------
 *
 * idempotency.c
 *	  The library's entry point: _PG_init registers what the extension adds
 *	  to the server; and the utility hook, which hands each statement to the
 *	  modules that look at it before it runs.
 *
 * Owns: the order of registration, and of the utility hook's calls.
 * May call: the register functions of citus/delegation_guard.h,
 *	  worker/launcher.h, infra/guc.h and infra/shmem.h; tables/guard.h and
 *	  infra/shmem.h from the utility hook.  Nothing includes this file's
 *	  symbols.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "fmgr.h"
#include "miscadmin.h"
#include "tcop/utility.h"

#include "citus/delegation_guard.h"
#include "worker/launcher.h"
#include "infra/guc.h"
#include "infra/shmem.h"
#include "tables/guard.h"

PG_MODULE_MAGIC;

void		_PG_init(void);

static ProcessUtility_hook_type prev_process_utility_hook = NULL;

/*
 * Each utility statement, before it runs: the DDL the extension's tables
 * refuse (an ERROR), then what it means to the shared state (the workers,
 * the launcher, the claims' waiters).
 */
static void
process_utility(PlannedStmt *pstmt, const char *queryString, bool readOnlyTree,
				ProcessUtilityContext context, ParamListInfo params,
				QueryEnvironment *queryEnv, DestReceiver *dest,
				QueryCompletion *qc)
{
	idem_guard_utility(pstmt->utilityStmt);
	idem_shmem_utility(pstmt->utilityStmt);

	if (prev_process_utility_hook)
		prev_process_utility_hook(pstmt, queryString, readOnlyTree, context, params,
								  queryEnv, dest, qc);
	else
		standard_ProcessUtility(pstmt, queryString, readOnlyTree, context, params,
								queryEnv, dest, qc);
}

/*
 * Define the settings; and, when loaded through shared_preload_libraries,
 * ask for shared memory, install the utility hook and register the
 * launcher (which would do nothing during pg_upgrade, where no worker may
 * write).
 */
void
_PG_init(void)
{
	idem_define_gucs();
	idem_delegation_guard_register();

	if (!process_shared_preload_libraries_in_progress)
		return;
	idem_shmem_register();
	prev_process_utility_hook = ProcessUtility_hook;
	ProcessUtility_hook = process_utility;
	if (!IsBinaryUpgrade)
		idem_register_launcher();
}
