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

#include "access/tupdesc.h"

/*
 * The columns of idempotency.claim_result: 7 at version 1.0 of the SQL
 * objects, 9 from 1.1 on (lease_expires_at and expires_at appended).  One
 * library serves databases at either version, so the result is built for
 * the type as the database declares it.
 */
#define IDEM_CLAIM_RESULT_NATTS 9
#define IDEM_CLAIM_RESULT_NATTS_1_0 7
extern const Oid idem_claim_result_types[IDEM_CLAIM_RESULT_NATTS];

/*
 * idem_claim's arguments: five in 1.0, six from 1.1, whose last is wait
 * (the library serves databases at either version).
 */
#define IDEM_CLAIM_MIN_NARGS	5
#define IDEM_CLAIM_MAX_NARGS	6
#define IDEM_CLAIM_WAIT_ARGNO	5

extern int	idem_claim_result_natts(TupleDesc desc);
extern Datum idem_claim(PG_FUNCTION_ARGS);
extern void idem_claim_columns(FunctionCallInfo fcinfo, Datum *values,
							   bool *nulls);

#endif							/* IDEMPOTENCY_KEYS_H */
