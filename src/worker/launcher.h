/*-------------------------------------------------------------------------
 *
 * launcher.h
 *	  The launcher of the per-database background workers.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_LAUNCHER_H
#define IDEMPOTENCY_LAUNCHER_H

extern void idem_register_launcher(void);

#endif							/* IDEMPOTENCY_LAUNCHER_H */
