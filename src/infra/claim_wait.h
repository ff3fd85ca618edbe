/*-------------------------------------------------------------------------
 *
 * claim_wait.h
 *	  idem_claim's wait: a claim that finds its key held by another request
 *	  sleeps until that request ends (or the wait runs out) instead of
 *	  answering in_progress at once.  See claim_wait.c.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_CLAIM_WAIT_H
#define IDEMPOTENCY_CLAIM_WAIT_H

#include "datatype/timestamp.h"
#include "fmgr.h"

struct ClaimWaitSlot;

/*
 * One claim's wait, on the caller's stack: claim_wait_start, then
 * claim_wait_sleep each time the key turns out held, then claim_wait_end
 * (also after an error: the transaction's end undoes what is left).
 */
typedef struct ClaimWait
{
	TimestampTz deadline;		/* 0: the claim does not wait */
	uint64		keyhash;		/* the key's hash (scope and key) */
	bool		started;		/* registered: the first look is done */
	struct ClaimWaitSlot *slot; /* the key's wait slot, or NULL: polling */
} ClaimWait;

/* shared memory, from shmem.c's hooks */
extern void idem_claim_wait_shmem_request(void);
extern void idem_claim_wait_shmem_init(void);

/* The waiting side (keys.c's idem_claim_columns). */
extern void claim_wait_start(ClaimWait *wait, FunctionCallInfo fcinfo,
							 int wait_argno, text *scope, text *key);
extern bool claim_wait_sleep(ClaimWait *wait, TimestampTz holder_lease_end);
extern void claim_wait_end(ClaimWait *wait);

/*
 * The holding side: this transaction claimed, completed, released or
 * otherwise changed the key; whoever waits for it is woken when the
 * transaction (or the subtransaction that changed it) ends.
 */
extern void claim_wait_key_changed(text *scope, text *key);
extern void claim_wait_all_changed(void);

#endif							/* IDEMPOTENCY_CLAIM_WAIT_H */
