/*-------------------------------------------------------------------------
 *
 * guc.h
 *	  The extension's settings, all under the reserved prefix "idempotency."
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_GUC_H
#define IDEMPOTENCY_GUC_H

#include "datatype/timestamp.h"

/* idempotency.key_ttl, in seconds */
extern int	idem_key_ttl_s;

/* idempotency.lease, in milliseconds */
extern int	idem_lease_ms;

/* idempotency.event_retention, in seconds */
extern int	idem_event_retention_s;

/* idempotency.outbox_backoff_min and _max, in milliseconds */
extern int	idem_outbox_backoff_min_ms;
extern int	idem_outbox_backoff_max_ms;

/* idempotency.outbox_max_attempts */
extern int	idem_outbox_max_attempts;

/* idempotency.outbox_retention, in seconds (0: delete when published) */
extern int	idem_outbox_retention_s;

/*
 * idempotency.notify_truncated_retention, in seconds: how long a row whose
 * NOTIFY went out truncated is kept after it is published, at least
 */
extern int	idem_notify_truncated_retention_s;

/* The background worker's settings. */
extern int	idem_naptime_ms;
extern int	idem_purge_interval_ms;
extern int	idem_purge_batch_size;
extern int	idem_purge_busy_share;
extern int	idem_publish_batch_size;
extern char *idem_databases;
extern int	idem_max_databases;

/* idempotency.wait_slots: -1 for twice MaxBackends */
extern int	idem_wait_slots;

/* idempotency.max_response_bytes: the largest body idem_complete stores */
extern int	idem_max_response_bytes;

/* idempotency.max_wait, in milliseconds: the largest wait idem_claim takes */
extern int	idem_max_wait_ms;
/* temporary: the keys' SPI path (issue 29 item 2's measurement) */
extern bool idem_keys_spi;

extern void idem_define_gucs(void);

/* Is this HTTP status transient (released, not stored)?  See release_statuses. */
extern bool idem_status_is_released(int status_code);

/* A positive number of milliseconds as an interval (for GUC defaults). */
extern Interval *idem_interval_from_ms(int64 ms);

#endif							/* IDEMPOTENCY_GUC_H */
