/*-------------------------------------------------------------------------
 *
 * outbox_ack.h
 *	  The acknowledgement's per-key order check, read from the outbox's
 *	  indexes directly (see outbox_ack.c).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_OUTBOX_ACK_H
#define IDEMPOTENCY_OUTBOX_ACK_H

#include "executor/spi.h"
#include "utils/array.h"
#include "utils/snapshot.h"

/*
 * Each key's taken rows that the order check lets through, oldest first,
 * for the keys with two or more: the write must take a prefix of each
 * (see acknowledge_on in outbox/outbox.c).
 */
typedef struct AckChains
{
	int			nids;
	int64	   *ids;
	bool	   *starts;			/* ids[i] is its key's first */
} AckChains;

extern ArrayType *outbox_ack_unblocked(ArrayType *ids, ArrayType *attempts, bool fenced,
									   Snapshot snapshot, AckChains *chains);

#endif							/* IDEMPOTENCY_OUTBOX_ACK_H */
