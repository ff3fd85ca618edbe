/*-------------------------------------------------------------------------
 *
 * worker_xact.h
 *	  The per-database worker's own transactions.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_WORKER_XACT_H
#define IDEMPOTENCY_WORKER_XACT_H

extern void worker_begin_unit(const char *activity);
extern void worker_lock_extension(void);
extern void worker_count_own_xid(void);
extern void worker_report_and_abort(void);
extern uint64 worker_take_own_xids(void);

#endif							/* IDEMPOTENCY_WORKER_XACT_H */
