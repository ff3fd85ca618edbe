/*-------------------------------------------------------------------------
 *
 * claim_scan.h
 *	  The planner hook and Custom Scan that run idem_claim in FROM.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_CLAIM_SCAN_H
#define IDEMPOTENCY_CLAIM_SCAN_H

extern void idem_claim_scan_register(void);

#endif							/* IDEMPOTENCY_CLAIM_SCAN_H */
