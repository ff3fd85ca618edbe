\set k random(1, 1000000000000)
INSERT INTO bench_events VALUES ('bench', :k::text, now(), now() + interval '14 days') ON CONFLICT DO NOTHING RETURNING true;
