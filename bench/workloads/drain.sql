SELECT coalesce(array_agg(id), '{}') AS ids, coalesce(array_agg(attempts), '{}') AS attempts FROM idempotency.idem_outbox_fetch('drain', 100, '30 seconds', :per_key) \gset
SELECT idempotency.idem_outbox_ack(:ids::bigint[], :attempts::int[]);
