-- The same semantics as idem_claim / idem_complete, written in PL/pgSQL the
-- way an application team would: in-flight detection with a transaction
-- advisory lock (a concurrent duplicate gets in_progress at once),
-- fingerprint mismatch, TTL, leases with takeover, and the release policy
-- for transient statuses.  The benchmark's second reference.

CREATE TABLE peer_keys (
	scope			 text COLLATE "C" NOT NULL,
	key				 text COLLATE "C" NOT NULL,
	fingerprint		 text,
	attempt			 integer NOT NULL,
	recovery_point	 text,
	lease_expires_at timestamptz,
	status_code		 integer,
	body			 text,
	headers			 jsonb,
	ttl				 interval NOT NULL,
	created_at		 timestamptz NOT NULL,
	completed_at	 timestamptz,
	expires_at		 timestamptz NOT NULL,
	PRIMARY KEY (scope, key)
) WITH (fillfactor = 80);

CREATE FUNCTION peer_claim(p_scope text, p_key text, p_fingerprint text DEFAULT NULL,
						   p_ttl interval DEFAULT '24 hours', p_lease interval DEFAULT '60 seconds',
						   OUT outcome text, OUT status_code int, OUT body text, OUT headers jsonb,
						   OUT attempt int, OUT recovery_point text, OUT created_at timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
	r peer_keys;
	now_ts timestamptz := clock_timestamp();
BEGIN
	IF p_key IS NULL OR p_scope IS NULL OR length(p_key) = 0 OR octet_length(p_key) > 255 THEN
		RAISE EXCEPTION 'invalid key' USING ERRCODE = '22023';
	END IF;
	-- another request working on this key right now: answer at once
	IF NOT pg_try_advisory_xact_lock(hashtextextended(p_scope || chr(1) || p_key, 0)) THEN
		outcome := 'in_progress';
		RETURN;
	END IF;
	SELECT * INTO r FROM peer_keys k WHERE k.scope = p_scope AND k.key = p_key;
	IF NOT FOUND OR r.expires_at <= now_ts THEN
		INSERT INTO peer_keys AS k VALUES (p_scope, p_key, p_fingerprint, 1, NULL, now_ts + p_lease,
			NULL, NULL, NULL, p_ttl, now_ts, NULL, now_ts + p_lease + p_ttl)
		ON CONFLICT (scope, key) DO UPDATE
			SET fingerprint = excluded.fingerprint, attempt = 1, recovery_point = NULL,
				lease_expires_at = excluded.lease_expires_at, status_code = NULL, body = NULL,
				headers = NULL, ttl = excluded.ttl, created_at = excluded.created_at,
				completed_at = NULL, expires_at = excluded.expires_at;
		outcome := 'claimed'; attempt := 1; created_at := now_ts;
		RETURN;
	END IF;
	IF r.fingerprint IS NOT NULL AND p_fingerprint IS NOT NULL AND r.fingerprint <> p_fingerprint THEN
		outcome := 'mismatch';
		RETURN;
	END IF;
	IF r.status_code IS NOT NULL THEN
		outcome := 'replay'; status_code := r.status_code; body := r.body; headers := r.headers;
		attempt := r.attempt; recovery_point := r.recovery_point; created_at := r.created_at;
		RETURN;
	END IF;
	IF r.lease_expires_at > now_ts THEN
		outcome := 'in_progress'; attempt := r.attempt; created_at := r.created_at;
		RETURN;
	END IF;
	UPDATE peer_keys k SET attempt = k.attempt + 1, lease_expires_at = now_ts + p_lease,
		expires_at = now_ts + p_lease + p_ttl
	WHERE k.scope = p_scope AND k.key = p_key
	RETURNING 'claimed', k.attempt, k.recovery_point, k.created_at
	INTO outcome, attempt, recovery_point, created_at;
END $$;

CREATE FUNCTION peer_complete(p_scope text, p_key text, p_status int, p_body text DEFAULT NULL,
							  p_headers jsonb DEFAULT NULL, p_attempt int DEFAULT NULL)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
	r peer_keys;
	now_ts timestamptz := clock_timestamp();
BEGIN
	IF p_status NOT BETWEEN 100 AND 599 THEN
		RAISE EXCEPTION 'invalid status %', p_status USING ERRCODE = '22023';
	END IF;
	SELECT * INTO r FROM peer_keys k WHERE k.scope = p_scope AND k.key = p_key FOR UPDATE;
	IF NOT FOUND OR r.expires_at <= now_ts THEN
		RAISE EXCEPTION 'key not claimed' USING ERRCODE = '22023';
	END IF;
	IF r.status_code IS NOT NULL THEN
		RAISE EXCEPTION 'key already completed' USING ERRCODE = '22023';
	END IF;
	IF p_attempt IS NOT NULL AND p_attempt <> r.attempt THEN
		RAISE EXCEPTION 'stale attempt' USING ERRCODE = '22023';
	END IF;
	IF p_status IN (408, 425, 429) OR p_status >= 500 THEN
		DELETE FROM peer_keys k WHERE k.scope = p_scope AND k.key = p_key;
		RETURN 'released';
	END IF;
	UPDATE peer_keys k SET status_code = p_status, body = p_body, headers = p_headers,
		lease_expires_at = NULL, completed_at = now_ts, expires_at = now_ts + r.ttl
	WHERE k.scope = p_scope AND k.key = p_key;
	RETURN 'stored';
END $$;
