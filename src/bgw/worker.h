/*-------------------------------------------------------------------------
 *
 * worker.h
 *	  The launcher and the per-database background workers.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_WORKER_H
#define IDEMPOTENCY_WORKER_H

extern void idem_register_launcher(void);

#endif							/* IDEMPOTENCY_WORKER_H */
