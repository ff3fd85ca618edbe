/*-------------------------------------------------------------------------
 *
 * keys.h
 *	  Idempotency keys: what the planner's direct scan of idem_claim
 *	  (claim_scan.c) shares with the SQL function (keys.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_KEYS_H
#define IDEMPOTENCY_KEYS_H

#include "fmgr.h"

/*
 * idem_claim's arguments: five in 1.0, six from 1.1, whose last is wait
 * (the library serves databases at either version).
 */
#define IDEM_CLAIM_MIN_NARGS	5
#define IDEM_CLAIM_MAX_NARGS	6
#define IDEM_CLAIM_WAIT_ARGNO	5

/* The columns of idempotency.claim_result. */
#define IDEM_CLAIM_RESULT_NATTS 7

extern Datum idem_claim(PG_FUNCTION_ARGS);
extern void idem_claim_columns(FunctionCallInfo fcinfo, Datum *values,
							   bool *nulls);

#endif							/* IDEMPOTENCY_KEYS_H */
