\set k random(1, 1000)
SELECT idempotency.idem_outbox_enqueue('e2e', '{"order_id": 123456, "customer": {"id": 987654, "name": "Alice Example", "email": "alice@example.com"}, "items": [{"sku": "SKU-0001", "qty": 2, "price": 19.99}, {"sku": "SKU-0002", "qty": 1, "price": 5.49}], "total": 45.47, "currency": "EUR", "status": "created", "note": "leave at the door"}'::jsonb, 'order-' || :k);
