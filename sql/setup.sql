--
-- setup: the extension, installed the way users install it.
--
CREATE EXTENSION idempotency;

-- every object lives in the schema idempotency, which is not relocatable
SELECT extname, extnamespace::regnamespace AS schema, extrelocatable
FROM pg_extension WHERE extname = 'idempotency';

-- the library is preloaded: the settings exist before the first call
SHOW idempotency.key_ttl;
SHOW idempotency.lease;
SHOW idempotency.release_statuses;
