--
-- keys_fingerprint: idem_fingerprint, and how idem_claim compares
-- fingerprints.
--
SET search_path = idempotency, public;

-- A fingerprint is 64 hex digits (SHA-256).
SELECT idem_fingerprint('{"amount": 10}'::jsonb) ~ '^[0-9a-f]{64}$' AS is_sha256_hex;

-- JSON that differs only in key order, white space or duplicate keys has
-- one fingerprint: what is hashed is jsonb's canonical text.
SELECT idem_fingerprint('{"a": 1, "b": [1, 2], "c": {"x": null, "y": "z"}}'::jsonb)
     = idem_fingerprint(E'{ "c":{"y":"z","x":null},\n\t"b":[1,2] ,"a":1 }'::jsonb) AS order_and_spacing;
SELECT idem_fingerprint('{"a": 1, "a": 2}'::jsonb)
     = idem_fingerprint('{"a": 2}'::jsonb) AS duplicate_keys_last_wins;
-- the canonical text it hashes
SELECT idem_fingerprint('{"b":2,"a":1}'::jsonb) = encode(sha256('{"a": 1, "b": 2}'::bytea), 'hex')
       AS hashes_canonical_text;

-- Numbers compare as written: 1 and 1.0 differ; array order matters.
SELECT idem_fingerprint('{"amount": 1}'::jsonb) = idem_fingerprint('{"amount": 1.0}'::jsonb) AS one_vs_one_point_zero;
SELECT idem_fingerprint('[1, 2]'::jsonb) = idem_fingerprint('[2, 1]'::jsonb) AS array_order;

-- text and bytea hash the bytes as given: white space matters there.
SELECT idem_fingerprint('{"a":1}'::text) = idem_fingerprint('{"a": 1}'::text) AS text_spacing_matters;
SELECT idem_fingerprint('abc'::text) = idem_fingerprint('\x616263'::bytea) AS text_equals_its_bytes;
SELECT idem_fingerprint('abc'::text) = encode(sha256('abc'::bytea), 'hex') AS text_is_sha256;
-- an untyped literal resolves to the text overload, not jsonb
SELECT idem_fingerprint('{"b":1,"a":2}') = idem_fingerprint('{"b":1,"a":2}'::text) AS literal_is_text;
-- NULL in, NULL out
SELECT idem_fingerprint(NULL::jsonb) IS NULL AS null_jsonb, idem_fingerprint(NULL::text) IS NULL AS null_text;

-- A claim with the same fingerprint replays; another fingerprint is a
-- mismatch (the caller answers 422), whatever the key's state.
SELECT outcome FROM idem_claim('f', 'k1', idem_fingerprint('{"amount": 10, "to": "bob"}'::jsonb));
SELECT outcome FROM idem_claim('f', 'k1', idem_fingerprint('{"amount": 99, "to": "bob"}'::jsonb));
SELECT outcome FROM idem_claim('f', 'k1', idem_fingerprint('{"to": "bob", "amount": 10}'::jsonb));
SELECT idem_complete('f', 'k1', 201, 'paid');
SELECT outcome, body FROM idem_claim('f', 'k1', idem_fingerprint('{"to":"bob","amount":10}'::jsonb));
SELECT outcome, status_code, body FROM idem_claim('f', 'k1', idem_fingerprint('{"amount": 99, "to": "bob"}'::jsonb));

-- A mismatch reveals nothing about the stored response.
SELECT status_code IS NULL AND body IS NULL AND headers IS NULL AND attempt IS NULL AS reveals_nothing
FROM idem_claim('f', 'k1', 'other');

-- NULL fingerprints match anything, stored or given:
-- stored NULL, given a fingerprint -> replay
SELECT outcome FROM idem_claim('f', 'stored-null');
SELECT idem_complete('f', 'stored-null', 200, 'ok');
SELECT outcome FROM idem_claim('f', 'stored-null', 'any fingerprint');
-- stored fingerprint, given NULL -> replay
SELECT outcome FROM idem_claim('f', 'given-null', 'fp-1');
SELECT idem_complete('f', 'given-null', 200, 'ok');
SELECT outcome FROM idem_claim('f', 'given-null');
SELECT outcome FROM idem_claim('f', 'given-null', NULL);

-- A takeover keeps the stored fingerprint, or records the first one given.
SELECT outcome FROM idem_claim('f', 'takeover', lease => '10 milliseconds');
SELECT pg_sleep(0.05);
SELECT outcome, attempt FROM idem_claim('f', 'takeover', 'fp-2', lease => '10 milliseconds');
SELECT fingerprint FROM keys WHERE scope = 'f' AND key = 'takeover';
SELECT pg_sleep(0.05);
SELECT outcome FROM idem_claim('f', 'takeover', 'fp-3');
-- a committed in-progress claim with another fingerprint is a mismatch too
SELECT outcome FROM idem_claim('f', 'in-progress', 'fp-a');
SELECT outcome FROM idem_claim('f', 'in-progress', 'fp-b');
