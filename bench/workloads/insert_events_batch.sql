\set k random(1, 1000000000000)
INSERT INTO bench_events SELECT 'bench', e, now(), now() + interval '14 days' FROM unnest(ARRAY(SELECT :k || '-' || n FROM generate_series(1, 500) n)) AS e ON CONFLICT DO NOTHING RETURNING event_id;
