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
# would restart) unless ALLOW_UPGRADE=1 says so.  No service starts during
# the install (see the policy below); the tests and the demo start servers
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

# the version of an installed package, or nothing (dpkg-query fails on a
# package it never saw)
installed_version() {
	{ dpkg-query -W -f '${Status} ${Version}\n' "$1" 2>/dev/null || true; } |
		sed -n 's/^install ok installed //p'
}

# apt-get installs the newest version of a new package's dependencies,
# upgrading those already installed: the server's packages, when
# installed, are named at their installed version (which keeps them), and
# the development package is taken at the server's own version when the
# archive still has it (its headers then match the server exactly).
keep=()
server_version=$(installed_version "postgresql-$PG_MAJOR")
if [ -z "${ALLOW_UPGRADE:-}" ]; then
	for pkg in "postgresql-$PG_MAJOR" "postgresql-client-$PG_MAJOR"; do
		version=$(installed_version "$pkg")
		[ -n "$version" ] && keep+=("$pkg=$version")
	done
fi
for i in "${!missing[@]}"; do
	if [ "${missing[$i]}" = "postgresql-server-dev-$PG_MAJOR" ] && [ -n "$server_version" ] &&
		apt-cache madison "postgresql-server-dev-$PG_MAJOR" | awk -F' *\\| *' '{ print $2 }' |
		grep -qxF "$server_version"; then
		missing[$i]="postgresql-server-dev-$PG_MAJOR=$server_version"
	fi
done

# What apt-get would do, before it does it: "Inst NAME [OLD] (NEW ...)" is
# an upgrade, "Inst NAME (NEW ...)" a new package.
apt_install=(apt-get install -y --no-install-recommends --no-upgrade)
plan=$("${apt_install[@]}" -s "${missing[@]}" "${keep[@]}") || {
	echo "$plan" >&2
	echo "apt-get cannot install: ${missing[*]}${keep[*]:+ (keeping ${keep[*]})}" >&2
	[ ${#keep[@]} -eq 0 ] || echo "ALLOW_UPGRADE=1 lets it upgrade the installed server" >&2
	exit 1
}
new=$(echo "$plan" | sed -n 's/^Inst \([^ ]*\) (\([^ ]*\) .*/\1/p' | wc -l)
upgrades=$(echo "$plan" | sed -n 's/^Inst \([^ ]*\) \[\([^]]*\)\] (\([^ ]*\) .*/\1 \2 -> \3/p')
echo "== installing with apt-get ($need): ${missing[*]}"
echo "   ($new new packages with their dependencies; apt-get's output follows)"
if [ -n "$upgrades" ]; then
	echo "   upgrading installed packages their dependencies need:"
	echo "$upgrades" | sed 's/^/     /'
	servers=$(echo "$upgrades" | grep -E '^postgresql-[0-9]+ ' || true)
	if [ -n "$servers" ] && [ -z "${ALLOW_UPGRADE:-}" ]; then
		echo "this would upgrade an installed PostgreSQL server (${servers%% *}), which restarts its" >&2
		echo "running clusters: upgrade it yourself first (apt-get install ${servers%% *})," >&2
		echo "or run again with ALLOW_UPGRADE=1" >&2
		exit 1
	fi
fi

# No service starts during the install: postgresql-NN's cluster, pgbouncer's
# and the exporter's services (newer exporters listen on :9187, every
# interface, even with no database configured) would start where an init
# system runs, and where none runs (a container, a chroot) their
# post-install scripts fail trying.  Unless the machine has a policy of its
# own, one that refuses every service (exit 101: "action forbidden", see
# invoke-rc.d(8)) is in place during the install.
policy=
if [ ! -e /usr/sbin/policy-rc.d ]; then
	policy=/usr/sbin/policy-rc.d
	trap 'rm -f "$policy"' EXIT
	printf '%s\n' '#!/bin/sh' '# scripts/deps.sh: no service starts while it installs' 'exit 101' >"$policy"
	chmod 755 "$policy"
fi
# the per-file lines of unpacking say nothing: the rest is shown
if ! "${apt_install[@]}" -q "${missing[@]}" "${keep[@]}" |
	{ grep -Ev '^(Get:|Selecting previously unselected|Preparing to unpack|Unpacking|\(Reading database)' || true; }; then
	echo "apt-get install failed: ${missing[*]}" >&2
	exit 1
fi
echo "== installed: ${missing[*]%%=*}"
echo "   (to remove them later: apt-get purge ${missing[*]%%=*} && apt-get autoremove)"
