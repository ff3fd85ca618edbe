/*-------------------------------------------------------------------------
 *
 * run_as.h
 *	  Running code as another role, with search_path pinned, and back.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_RUN_AS_H
#define IDEMPOTENCY_RUN_AS_H

/* What idem_run_as_begin changed, for idem_run_as_end to restore. */
typedef struct IdemRunAs
{
	Oid			saved_userid;
	int			saved_sec_context;
	int			guc_nest_level;
} IdemRunAs;

extern void idem_run_as_begin(IdemRunAs *context, Oid role, int sec_context);
extern void idem_run_as_end(IdemRunAs *context, bool keep_sets);

#endif							/* IDEMPOTENCY_RUN_AS_H */
