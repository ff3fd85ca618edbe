/*-------------------------------------------------------------------------
 *
 * subxact.h
 *	  Running a piece of work in a subtransaction of its own.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_SUBXACT_H
#define IDEMPOTENCY_SUBXACT_H

/* What becomes of the subtransaction when the work succeeds. */
typedef enum SubxactEnd
{
	SUBXACT_RELEASE,			/* kept: what it did is the transaction's */
	SUBXACT_ROLL_BACK			/* undone all the same (its locks let go) */
} SubxactEnd;

typedef void (*SubxactWork) (void *arg);
typedef bool (*SubxactCatches) (const ErrorData *error);

extern ErrorData *idem_subxact_run(SubxactWork work, void *arg, SubxactEnd end,
								   SubxactCatches catches);

#endif							/* IDEMPOTENCY_SUBXACT_H */
