/*-------------------------------------------------------------------------
 *
 * subxact.c
 *	  A piece of work in a subtransaction of its own, written once: the
 *	  memory context and resource owner put back as the subtransaction
 *	  found them, however it ends, and an ERROR caught or let through.
 *
 * Owns: nothing.
 * May call: the server only.  Called by outbox/publish.c (each row's
 *	  publication, idem_run_maintenance's batches), tables/tables.c (the
 *	  outbox sequence's move).
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "access/xact.h"
#include "utils/memutils.h"
#include "utils/resowner.h"

#include "infra/subxact.h"

/*
 * Run work(arg) in a subtransaction of its own, in the caller's memory
 * context, as PL/pgSQL runs a block with an EXCEPTION clause.  When work
 * returns, the subtransaction is released (its work becomes the current
 * transaction's) or, with SUBXACT_ROLL_BACK, rolled back all the same (to
 * let go of its locks), and NULL is returned.
 *
 * An ERROR rolls the subtransaction back, and is returned, copied into the
 * caller's memory context, if catches(error) says it is the work's to
 * catch; otherwise (or without catches) it is thrown again, once the
 * subtransaction is gone.  Either way the caller's memory context and
 * resource owner are back in place.
 */
ErrorData *
idem_subxact_run(SubxactWork work, void *arg, SubxactEnd end, SubxactCatches catches)
{
	MemoryContext context = CurrentMemoryContext;
	ResourceOwner owner = CurrentResourceOwner;
	ErrorData  *volatile error = NULL;

	BeginInternalSubTransaction(NULL);
	MemoryContextSwitchTo(context);
	PG_TRY();
	{
		work(arg);
		if (end == SUBXACT_ROLL_BACK)
			RollbackAndReleaseCurrentSubTransaction();
		else
			ReleaseCurrentSubTransaction();
	}
	PG_CATCH();
	{
		MemoryContextSwitchTo(context);
		error = CopyErrorData();
		FlushErrorState();
		RollbackAndReleaseCurrentSubTransaction();
	}
	PG_END_TRY();
	MemoryContextSwitchTo(context);
	CurrentResourceOwner = owner;

	if (error != NULL && (catches == NULL || !catches(error)))
		ReThrowError(error);
	return error;
}
