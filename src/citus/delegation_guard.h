/*-------------------------------------------------------------------------
 *
 * delegation_guard.h
 *	  The planner hook that refuses a query from which Citus would delegate
 *	  one of the extension's functions and crash.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_DELEGATION_GUARD_H
#define IDEMPOTENCY_DELEGATION_GUARD_H

extern void idem_delegation_guard_register(void);

#endif							/* IDEMPOTENCY_DELEGATION_GUARD_H */
