# idempotency: a PostgreSQL extension for retry-safe APIs.
#
#   make test   install what is missing, build, install, and run every suite
#               (pg_regress, isolation, TAP) against temporary instances
#   make demo   a tour of the extension on a throwaway cluster (installs only
#               the server, its client and development packages, and a compiler)
#   make bench  the benchmarks, side by side with plain SQL (not a test)
#   make test-matrix  make test on Debian bookworm, trixie and sid (PostgreSQL
#               15, 17, 18), each in a chroot of its own (scripts/matrix.sh)
#
# They are scripts under scripts/; the rest of this file is a plain PGXS
# build.  PG_CONFIG picks the server version (default: the newest installed
# under /usr/lib/postgresql, else the pg_config on the PATH).

EXTENSION = idempotency
MODULE_big = idempotency
# By concern, each a folder under src/ with its SQL-facing functions and
# its data path: keys/, events/, outbox/, worker/ (the background work),
# tables/ (the extension's tables), citus/ (the Citus adapter), infra/
# (what they share).  src/README.md says what each may call.
OBJS = \
	src/idempotency.o \
	src/keys/fingerprint.o \
	src/keys/keys.o \
	src/events/events.o \
	src/outbox/outbox.o \
	src/outbox/outbox_ack.o \
	src/outbox/outbox_sql.o \
	src/outbox/publish.o \
	src/worker/launcher.o \
	src/worker/purge.o \
	src/worker/run_maintenance.o \
	src/worker/worker.o \
	src/tables/guard.o \
	src/tables/table_check.o \
	src/tables/tables.o \
	src/citus/delegation_guard.o \
	src/citus/shards.o \
	src/infra/args.o \
	src/infra/claim_wait.o \
	src/infra/guc.o \
	src/infra/maintenance.o \
	src/infra/plan_settings.o \
	src/infra/run_as.o \
	src/infra/shmem.o \
	src/infra/subxact.o \
	src/infra/upgrade.o \
	src/infra/worker_xact.o
DATA = idempotency--1.0.sql idempotency--1.0--1.1.sql idempotency--1.1--1.2.sql
PGFILEDESC = "idempotency - retry-safe APIs for PostgreSQL"

# Warnings are errors.  -Wextra's unused-parameter fires on the server's own
# headers and on callback signatures (hooks, relcache callbacks), so it
# stays off.
PG_CFLAGS = -Wall -Wextra -Werror -Wno-unused-parameter
# Our headers are included by their path under src/ ("worker/worker.h"), so
# that each #include says which layer it reaches into.
PG_CPPFLAGS = -I$(srcdir)/src

TEST_CONF = $(CURDIR)/test/idempotency.conf

# pg_regress: one file per topic under sql/, expected output under expected/
REGRESS = setup keys_claim keys_claim_scan keys_complete keys_lease keys_extend_lease keys_wait keys_fingerprint keys_input \
	keys_release_policy keys_security events events_batch maintenance_purge outbox outbox_batch outbox_routes ddl_guard outbox_fetch_plan

# pg_isolation_regress: specs/*.spec, expected output under expected/
ISOLATION = claim_concurrent claim_rollback claim_lease claim_isolation_levels claim_result_times claim_wait claim_wait_lease \
	events_concurrent events_batch_concurrent outbox_order outbox_relays outbox_per_key outbox_fences

# TAP: t/*.pl, each starting its own PostgreSQL::Test::Cluster
TAP_TESTS = 1

# "make installcheck" (PGXS) runs the pg_regress and isolation suites against
# a running server whose shared_preload_libraries already has idempotency
# (PGHOST, PGPORT, PGUSER: a superuser), then the TAP suite, which starts
# clusters of its own (skip it with "make installcheck TAP_TESTS=").  The
# check-* targets below run each suite against a temporary instance instead.

PG_CONFIG ?= $(or $(shell ls -d /usr/lib/postgresql/*/bin/pg_config 2>/dev/null | sort -V | tail -n 1),pg_config)
PGXS := $(shell $(PG_CONFIG) --pgxs 2>/dev/null)

ifneq ($(PGXS),)
include $(PGXS)
else
all:
	@echo "PostgreSQL's server development files are missing: run 'make test' (as root, it installs them) or install postgresql-server-dev-NN." >&2
	@exit 1
endif

# PGXS does not track header dependencies unless the server was configured
# with --enable-depend: rebuild every object when any header changes.
$(OBJS): $(wildcard src/*.h src/*/*.h)

# The include graph of src/'s modules, one line per module; fails on a
# cycle, or on an extern that no other module uses (scripts/include-graph.py;
# make test runs it with the build, --dot draws it for Graphviz)
.PHONY: include-graph
include-graph:
	python3 scripts/include-graph.py

.PHONY: test demo bench bench-http bench-citus soak-citus test-matrix check-regress check-isolation check-tap check-citus check-examples check-installcheck

# The scripts pick the server version themselves (scripts/common.sh): a
# PG_CONFIG or PG_MAJOR given on make's command line or in the environment
# reaches them as it is (make exports both), and without either they take
# the newest installed or, on a fresh system, this Debian release's default
# server, which they install.
test:
	scripts/test.sh

demo:
	scripts/demo.sh

bench:
	scripts/bench.sh

# the HTTP middleware against its handler alone (FRAMEWORKS="express fastapi")
bench-http:
	bench/http.sh

# MATRIX="17 18" (or suite names) picks a subset
test-matrix:
	scripts/matrix.sh

# The three suites one by one, against the installed extension; scripts/test.sh
# runs all of them and reports each.
check-regress:
	$(pg_regress_installcheck) $(REGRESS_OPTS) --temp-config=$(TEST_CONF) \
		--temp-instance=$(CURDIR)/tmp_check $(REGRESS)

check-isolation:
	$(pg_isolation_regress_installcheck) $(ISOLATION_OPTS) --temp-config=$(TEST_CONF) \
		--temp-instance=$(CURDIR)/tmp_check_iso $(ISOLATION)

check-tap:
	$(prove_installcheck)

# t/citus/*.pl: a coordinator and two workers, when the citus extension is
# installed in this server (it is not among Debian's packages: see
# doc/integrations/citus.md); without it, one line says the suite did not run
CITUS_INSTALLED = $(wildcard $(shell $(PG_CONFIG) --sharedir 2>/dev/null)/extension/citus.control)
check-citus: PROVE_TESTS = t/citus/*.pl
check-citus:
ifneq ($(CITUS_INSTALLED),)
	$(prove_installcheck)
else
	@echo "citus suite: not run (citus is not installed in this server)"
endif

# bench/citus.pl: claim + complete and replay through a Citus coordinator
# against one node, with the extension installed (make install) in a server
# that has citus too
bench-citus: PROVE_TESTS = bench/citus.pl
bench-citus: PROVE_FLAGS += --verbose
bench-citus:
ifneq ($(CITUS_INSTALLED),)
	$(prove_installcheck)
else
	@echo "bench-citus: not run (citus is not installed in this server)"
endif

# bench/citus_soak.pl: the Citus soak, SOAK_MINUTES minutes (1), SOAK_FAULT
# to plant a fault; ends with its "citus soak: ..." line
soak-citus: PROVE_TESTS = bench/citus_soak.pl
soak-citus: PROVE_FLAGS += --verbose
soak-citus:
ifneq ($(CITUS_INSTALLED),)
	$(prove_installcheck)
else
	@echo "soak-citus: not run (citus is not installed in this server)"
endif

# clients/*/test.sh and examples/*/test.sh against a temporary instance, directly and through
# pgbouncer in transaction pooling mode
check-examples:
	PG_CONFIG=$(PG_CONFIG) scripts/with-server.sh scripts/test-examples.sh

# installcheck's pg_regress and isolation suites, against a temporary
# instance started the way an existing preloading server would be
check-installcheck:
	PG_CONFIG=$(PG_CONFIG) scripts/with-server.sh \
		$(MAKE) --no-print-directory PG_CONFIG=$(PG_CONFIG) installcheck TAP_TESTS=

# The SQL edition (sql-edition/, PL/pgSQL and SQL only, for servers without
# the C library): dist/idempotency-sql--<version>.sql, assembled from the C
# edition's scripts and sql-edition/*.sql (scripts/build-sql-edition.py)
.PHONY: dist check-sql-edition check-pgtle
dist:
	python3 scripts/build-sql-edition.py

# The SQL edition installed by a role without superuser on a server without
# the C library, its catalog compared with the C edition's, and the C
# edition's key and event tests run against it, with the differences of
# sql-edition/differences.patch (scripts/check-sql-edition.sh)
check-sql-edition:
	PG_CONFIG=$(PG_CONFIG) scripts/check-sql-edition.sh

# The same, the edition registered with pg_tle (dist/idempotency-pgtle--*.sql)
# and created with CREATE EXTENSION by a role holding pgtle_admin, when
# pg_tle is installed in this server (Debian does not ship it: see
# doc/testing.md); without it, one line says the suite did not run
PGTLE_INSTALLED = $(wildcard $(shell $(PG_CONFIG) --sharedir)/extension/pg_tle.control)
check-pgtle:
ifneq ($(PGTLE_INSTALLED),)
	PG_CONFIG=$(PG_CONFIG) VIA=pgtle scripts/check-sql-edition.sh
else
	@echo "pgtle suite: not run (pg_tle is not installed in this server: see doc/testing.md)"
endif

# The Debian package (debian/, pg_buildext): built in a scratch copy,
# installed, and tested with installcheck against the installed library
# (as root; scripts/check-deb.sh)
.PHONY: check-deb
check-deb:
	PG_CONFIG=$(PG_CONFIG) scripts/check-deb.sh

# The fuzzers, bounded to a minute or two: test/fuzz/fuzz_args.py (every
# function with hostile arguments, and races between sessions) and Debian's
# sqlsmith, against a temporary instance that preloads the library
# (scripts/check-fuzz.sh; SUITES=fuzz make test runs it)
.PHONY: check-fuzz
check-fuzz:
	PG_CONFIG=$(PG_CONFIG) scripts/check-fuzz.sh

# installcheck's pg_regress and isolation suites, and the fuzzers of
# check-fuzz, against a temporary server that loads a build made with
# AddressSanitizer and UndefinedBehaviorSanitizer from a private copy of the
# server's lib dir (the installed library stays as it is), then the TAP
# suite, t/*.pl, with its clusters started from that copy (SUITES picks a
# subset; "citus" adds t/citus/*.pl); fails on any sanitizer report as on
# any suite failure (scripts/check-sanitize.sh)
.PHONY: check-sanitize
check-sanitize:
	PG_CONFIG=$(PG_CONFIG) scripts/check-sanitize.sh

# The README's quick start, its commands as written there, as root in a
# fresh copy of a minimal Debian 12 without init (debootstrap
# --variant=minbase, made once and cached): the install must start no
# service and leave nothing running (scripts/check-quickstart.sh;
# QUICKSTART_SUITES picks make test's suites there)
.PHONY: check-quickstart
check-quickstart:
	scripts/check-quickstart.sh

# Every ```sql block of README.md and doc/**/*.md, run in order in a fresh
# database per file against a temporary instance that preloads the library;
# the conventions (hidden setup, skipped blocks) are at the top of
# scripts/check-docs.sh (SUITES=docs make test runs it)
.PHONY: check-docs
check-docs:
	PG_CONFIG=$(PG_CONFIG) scripts/check-docs.sh
