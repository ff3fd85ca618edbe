/*-------------------------------------------------------------------------
 *
 * guard.h
 *	  Refusing, when it is run, the DDL that would break what the direct
 *	  path relies on (called from the utility hook).
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_GUARD_H
#define IDEMPOTENCY_GUARD_H

#include "nodes/nodes.h"

extern void idem_guard_utility(Node *statement);

#endif							/* IDEMPOTENCY_GUARD_H */
