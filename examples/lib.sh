# Sourced by clients/*/test.sh and examples/*/test.sh (bash, set -euo
# pipefail, run from their own folder): what every Node and every Python
# test script needs before its tests, written once.

# need_node: node and npm are there, and the packages the folder's
# package-lock.json pins are in ./node_modules (npm ci; the npm cache in the
# scratch folder, so that this works as any user).
need_node() {
	local tool
	for tool in node npm; do
		command -v "$tool" >/dev/null || {
			echo "$tool is missing: apt-get install nodejs npm (make test does it as root)" >&2
			exit 1
		}
	done
	export npm_config_cache=${npm_config_cache:-${EXAMPLE_TMP:-${TMPDIR:-/tmp}}/npm-cache}
	export npm_config_update_notifier=false
	if ! npm ci --no-audit --no-fund --loglevel=error; then
		# npm's cache names its temporary files from 4 random bytes and
		# opens them exclusively, so that now and then one exists already
		# (EEXIST on _cacache/tmp/..., npm/cli#7308; seen once in the
		# bookworm chroot): once more, with a cache of its own
		echo "npm ci failed: once more, with an empty cache" >&2
		export npm_config_cache=$npm_config_cache.again
		npm ci --no-audit --no-fund --loglevel=error
	fi
}

# need_python MODULE:PACKAGE...: Debian's python3 ($PY) imports each module,
# else the script fails naming the Debian packages to install.  Django 3.2
# (bookworm) runs on psycopg2, 4.2 and later on psycopg 3: "django:…" also
# asks for psycopg2 where Django is older than 4.2.
PY=/usr/bin/python3
export PYTHONDONTWRITEBYTECODE=1
need_python() {
	local need missing=()
	for need in "$@"; do
		$PY -c "import ${need%%:*}" 2>/dev/null || missing+=("${need#*:}")
		if [ "${need%%:*}" = django ]; then
			$PY -c 'import django, sys; sys.exit(django.VERSION < (4, 2))' 2>/dev/null ||
				$PY -c 'import psycopg2' 2>/dev/null || missing+=(python3-psycopg2)
		fi
	done
	if [ ${#missing[@]} -gt 0 ]; then
		echo "missing Debian packages: ${missing[*]} (scripts/deps.sh installs them as root)" >&2
		exit 1
	fi
}

# run_orders_test: the Python examples' shared HTTP tests (../orders_test.py,
# which starts ./serve), with the app's log shown if they fail.
run_orders_test() {
	local status=0
	export EXAMPLE_DIR=$PWD EXAMPLE_TMP=${EXAMPLE_TMP:-$(mktemp -d)}
	mkdir -p "$EXAMPLE_TMP"
	$PY -m pytest -q -p no:cacheprovider --durations=3 ../orders_test.py || status=$?
	if [ $status -ne 0 ]; then
		echo "-- $EXAMPLE_TMP/serve.log (last 40 lines)"
		tail -n 40 "$EXAMPLE_TMP/serve.log"
	fi
	return $status
}
