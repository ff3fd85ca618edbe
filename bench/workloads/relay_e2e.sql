SELECT coalesce(array_agg(id), '{}') AS ids, coalesce(array_agg(attempts), '{}') AS attempts FROM idempotency.idem_outbox_fetch('e2e', 100, '30 seconds') \gset
SELECT idempotency.idem_outbox_ack(:ids::bigint[], :attempts::int[]);
