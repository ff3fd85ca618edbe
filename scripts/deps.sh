#!/usr/bin/env bash
#
# scripts/deps.sh [demo|test]: install what is missing, for the server
# version that scripts/common.sh picks (PG_MAJOR, PG_CONFIG, or what is
# installed, or this Debian release's default).
#
#   demo   what building the extension and make demo need: a C compiler,
#          make, the server, its client and development packages
#   test   (the default) that, and what the test suites need besides: perl's
#          IPC::Run (TAP), python3 and psycopg, Node.js and npm, pgbouncer,
#          pg_cron, sqlsmith and the Prometheus exporter
#
# As root, missing Debian packages are installed with apt-get; otherwise the
# script says what to install and fails.  Before installing, it says which
# packages it installs and which installed ones their dependencies upgrade;
# it never upgrades an installed server (postgresql-NN: its running clusters
# would restart) unless ALLOW_UPGRADE=1 says so, and no service starts
# during the install (scripts/apt.sh); the tests and the demo start servers
# of their own.
#
set -euo pipefail
# no silent end: set -e stops at the first failure, which must say where
trap 'echo "scripts/deps.sh: failed at line $LINENO" >&2' ERR
. "$(dirname "$0")/common.sh"

need=${1:-test}
case $need in
demo | test) ;;
*)
	echo "usage: scripts/deps.sh [demo|test]" >&2
	exit 2
	;;
esac

pgbin=/usr/lib/postgresql/$PG_MAJOR/bin
missing=()

command -v gcc >/dev/null || missing+=(gcc)
command -v make >/dev/null || missing+=(make)
[ -x "$pgbin/postgres" ] || missing+=("postgresql-$PG_MAJOR")
[ -x "$pgbin/psql" ] && [ -x "$pgbin/pgbench" ] || missing+=("postgresql-client-$PG_MAJOR")
# pgxs.mk alone is not enough: Debian's client package ships it too, and
# only the server-dev package brings the headers
[ -f "/usr/lib/postgresql/$PG_MAJOR/lib/pgxs/src/makefiles/pgxs.mk" ] &&
	[ -f "/usr/include/postgresql/$PG_MAJOR/server/postgres.h" ] ||
	missing+=("postgresql-server-dev-$PG_MAJOR")
if [ "$need" = test ]; then
	command -v prove >/dev/null || missing+=(perl)
	perl -MIPC::Run -e 1 2>/dev/null || missing+=(libipc-run-perl)
	command -v python3 >/dev/null || missing+=(python3)
	# the SQL edition's suite applies sql-edition/differences.patch to the tests
	command -v patch >/dev/null || missing+=(patch)
	# The integrations that make test drives for real (examples/, t/007,
	# t/008): the HTTP example (Debian's psycopg 3, for the system python3),
	# the Node consumer (Node.js and npm; packages come from the npm registry,
	# pinned by the example's lockfile), pgbouncer, and pg_cron; and for the
	# fuzz suite, Debian's sqlsmith.
	/usr/bin/python3 -c 'import psycopg' 2>/dev/null || missing+=(python3-psycopg)
	# clients/python and examples/{fastapi,django,flask}: the frameworks,
	# their servers, pytest, and what the offline `pip install` of the
	# package needs (a venv: ensurepip; the build: setuptools and wheel).
	# Django 3.2 (bookworm) runs on psycopg2, later ones on psycopg 3.
	for module in psycopg_pool:python3-psycopg-pool fastapi:python3-fastapi \
		starlette:python3-starlette uvicorn:python3-uvicorn django:python3-django \
		flask:python3-flask gunicorn:python3-gunicorn pytest:python3-pytest \
		ensurepip:python3-venv setuptools:python3-setuptools wheel:python3-wheel; do
		/usr/bin/python3 -c "import ${module%%:*}" 2>/dev/null || missing+=("${module#*:}")
	done
	/usr/bin/python3 -c 'import django, sys; sys.exit(django.VERSION < (4, 2))' 2>/dev/null ||
		/usr/bin/python3 -c 'import psycopg2' 2>/dev/null || missing+=(python3-psycopg2)
	command -v node >/dev/null || missing+=(nodejs)
	command -v npm >/dev/null || missing+=(npm)
	[ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
	command -v sqlsmith >/dev/null || missing+=(sqlsmith)
	[ -f "/usr/share/postgresql/$PG_MAJOR/extension/pg_cron.control" ] ||
		missing+=("postgresql-$PG_MAJOR-cron")
	# t/012 starts Debian's Prometheus exporter with prometheus/queries.yaml
	[ -x /usr/bin/prometheus-postgres-exporter ] || missing+=(prometheus-postgres-exporter)
fi

[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
	echo "missing packages: ${missing[*]}" >&2
	echo "install them as root: apt-get install --no-install-recommends ${missing[*]}" >&2
	exit 1
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update -qq

. "$(dirname "$0")/apt.sh"
apt_guarded_install "$PG_MAJOR" "$need" --no-upgrade -- "${missing[@]}" || exit 1
echo "== installed: ${missing[*]%%=*}"
echo "   (to remove them later: apt-get purge ${missing[*]%%=*} && apt-get autoremove)"
