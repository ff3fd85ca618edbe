/*-------------------------------------------------------------------------
 *
 * run_as.c
 *	  Running code as another role, in the manner of a SECURITY DEFINER
 *	  function: the outbox's statements as the owner of the extension's
 *	  tables (outbox/outbox_sql.c), a route's function as the role that set
 *	  the route (outbox/publish.c).
 *
 * Owns: the switch of user and security context, and the search_path
 *	  pinned to pg_catalog, pg_temp meanwhile.
 * May call: the server only.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "miscadmin.h"
#include "utils/guc.h"

#include "infra/run_as.h"

/*
 * Become role, with sec_context added to the security context (at least
 * SECURITY_LOCAL_USERID_CHANGE), and search_path pinned to pg_catalog,
 * pg_temp.  An error before idem_run_as_end is cleaned up by the
 * (sub)transaction's abort, which restores the user and the settings.
 */
void
idem_run_as_begin(IdemRunAs *context, Oid role, int sec_context)
{
	GetUserIdAndSecContext(&context->saved_userid, &context->saved_sec_context);
	SetUserIdAndSecContext(role, context->saved_sec_context | sec_context);
	context->guc_nest_level = NewGUCNestLevel();
	(void) set_config_option("search_path", "pg_catalog, pg_temp",
							 PGC_USERSET, PGC_S_SESSION, GUC_ACTION_SAVE,
							 true, 0, false);
}

/*
 * Back to the saved user and settings.  keep_sets is AtEOXact_GUC's
 * isCommit: whether a SET run meanwhile outlives this (search_path is
 * restored either way).
 */
void
idem_run_as_end(IdemRunAs *context, bool keep_sets)
{
	AtEOXact_GUC(keep_sets, context->guc_nest_level);
	SetUserIdAndSecContext(context->saved_userid, context->saved_sec_context);
}
