\set k random(1, 100000)
SELECT status_code, body, headers FROM bench_replay WHERE scope = 'replay' AND key = :k::text;
