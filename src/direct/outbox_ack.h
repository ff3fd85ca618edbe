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

#include "utils/array.h"
#include "utils/snapshot.h"

extern ArrayType *outbox_ack_unblocked(ArrayType *ids, ArrayType *attempts, bool fenced,
									   Snapshot snapshot, ArrayType **held);

#endif							/* IDEMPOTENCY_OUTBOX_ACK_H */
