#!/usr/bin/env bash
#
# bench/http.sh: the HTTP part of the benchmarks (issue 32 "Speed"), apart
# from make bench. For each framework of FRAMEWORKS (default "express
# fastapi"), examples/<framework>/serve runs twice on a throwaway cluster:
# with its Idempotency-Key middleware, and with IDEM_MIDDLEWARE=off (the same
# handler and row, in a transaction of its own: Express's BEGIN, the insert
# and COMMIT, FastAPI's insert alone in autocommit, one round trip, or with
# BENCH_BASELINE=transaction, BEGIN, the insert, COMMIT). wrk drives POST /orders
# with 8 connections (BENCH_CONNECTIONS), BENCH_SECONDS (10) a run,
# BENCH_ROUNDS (3) rounds, which side goes first alternating (the apps on
# free ports from BENCH_PORT, else from a random one), for:
#
#   new keys   every request a new key: the middleware's claim and
#              completion against the handler alone (bar: 0.7x)
#   replays    every request the same key: the stored answer against the
#              handler alone (bar: 1x, a replay skips the handler)
#
# Each line gives the median of the rounds' ratios (with / without), the
# rounds, and the latency the middleware adds at p50 and p99 (the medians'
# difference). A framework without examples/<framework>/serve is skipped.
#
# As root it installs wrk (Debian's package) and what scripts/deps.sh
# installs, and runs the servers as the "postgres" OS user, in a copy of the
# tree that user owns.
#
set -euo pipefail
cd "$(dirname "$0")/.."

FRAMEWORKS=${FRAMEWORKS:-express fastapi}
SECONDS_A_RUN=${BENCH_SECONDS:-10}
ROUNDS=${BENCH_ROUNDS:-3}
CONNECTIONS=${BENCH_CONNECTIONS:-8}

# Inside scripts/with-server.sh (below): the benchmark itself
if [ "${1:-}" = --inside ]; then
	PGBIN=$("$PG_CONFIG" --bindir)
	psql() { "$PGBIN/psql" -X -q -v ON_ERROR_STOP=1 "$@"; }
	psql -d postgres -c 'CREATE DATABASE bench_http'
	psql -d bench_http -c 'CREATE EXTENSION idempotency'
	export PGDATABASE=bench_http
	export npm_config_cache=$PWD/npm-cache npm_config_update_notifier=false
	log=$PWD/http-logs
	mkdir -p "$log"
	pids=()
	trap 'for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done' EXIT

	free_port() {
		local port=${BENCH_PORT:-}
		[ -n "$port" ] || port=$((20000 + RANDOM % 20000))
		while (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do port=$((port + 1)); done
		echo "$port"
	}
	# serve FRAMEWORK NAME [ENV...]: the app on a free port, once it listens
	serve() {
		local fw=$1 name=$2 port
		shift 2
		port=$(free_port)
		env "$@" "examples/$fw/serve" "$port" >"$log/$name.log" 2>&1 &
		pids+=($!)
		for _ in $(seq 600); do
			grep -qi listening "$log/$name.log" 2>/dev/null && break
			kill -0 "${pids[-1]}" 2>/dev/null || break
			sleep 0.1
		done
		grep -qi listening "$log/$name.log" || {
			echo "examples/$fw/serve did not start:" >&2
			cat "$log/$name.log" >&2
			exit 1
		}
		eval "port_$name=$port"
	}
	# load PORT [KEY]: one wrk run; prints "rps p50_us p99_us"
	load() {
		local out
		out=$(IDEM_KEY=${2:-} IDEM_RUN="$RANDOM$RANDOM" wrk -t2 -c"$CONNECTIONS" -d"${SECONDS_A_RUN}s" \
			-s bench/http/orders.lua "http://127.0.0.1:$1" | grep '^RESULT')
		read -r _ requests seconds p50 p99 bad errors <<<"$out"
		if [ "$bad" -ne 0 ] || [ "$errors" -ne 0 ]; then
			echo "wrk on port $1: $bad answers not 2xx/3xx, $errors socket errors" >&2
			exit 1
		fi
		echo "$(awk -v r="$requests" -v s="$seconds" 'BEGIN { printf "%.0f", r / s }') $p50 $p99"
	}
	median() { tr ' ' '\n' | grep . | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

	for fw in $FRAMEWORKS; do
		if [ ! -x "examples/$fw/serve" ]; then
			echo "http $fw: skipped, there is no examples/$fw/serve"
			continue
		fi
		serve "$fw" with
		serve "$fw" without IDEM_MIDDLEWARE=off IDEM_BASELINE="${BENCH_BASELINE:-}"
		load "$port_with" >/dev/null # warm up both
		load "$port_without" >/dev/null
		for kind in new replay; do
			ratios='' with_rps='' without_rps='' p50_add='' p99_add=''
			for round in $(seq "$ROUNDS"); do
				key=''
				[ $kind = replay ] && key="replay-$fw-$round-$RANDOM"
				if [ $((round % 2)) -eq 1 ]; then
					read -r w50 w50p w99p <<<"$(load "$port_with" "$key")"
					read -r o50 o50p o99p <<<"$(load "$port_without" "$key")"
				else
					read -r o50 o50p o99p <<<"$(load "$port_without" "$key")"
					read -r w50 w50p w99p <<<"$(load "$port_with" "$key")"
				fi
				ratios+=" $(awk -v a="$w50" -v b="$o50" 'BEGIN { printf "%.2f", a / b }')"
				with_rps+=" $w50" without_rps+=" $o50"
				p50_add+=" $((w50p - o50p))" p99_add+=" $((w99p - o99p))"
			done
			bar=0.70 label='new keys'
			[ $kind = replay ] && bar=1.00 label='replays'
			[ -n "${BENCH_BASELINE:-}" ] && label+=" (baseline $BENCH_BASELINE)"
			printf 'http %s %s: %s / %s req/s, ratio %s (bar %s; rounds%s), added latency p50 %+.2f ms, p99 %+.2f ms\n' \
				"$fw" "$label" "$(median <<<"$with_rps")" "$(median <<<"$without_rps")" \
				"$(median <<<"$ratios")" "$bar" "$ratios" \
				"$(awk -v u="$(median <<<"$p50_add")" 'BEGIN { print u / 1000 }')" \
				"$(awk -v u="$(median <<<"$p99_add")" 'BEGIN { print u / 1000 }')"
		done
		for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
		wait 2>/dev/null || true
		pids=()
	done
	exit 0
fi

. scripts/common.sh
scripts/deps.sh
use_server
if ! command -v wrk >/dev/null; then
	if [ "$(id -u)" -ne 0 ]; then
		echo "wrk is missing: apt-get install wrk" >&2
		exit 1
	fi
	echo "installing: wrk"
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends wrk >/dev/null
fi
if [ ! -f "$("$PG_CONFIG" --sharedir)/extension/idempotency.control" ]; then
	build_and_install
fi

copy=$(runner_tmpdir bench-http)
trap 'rm -rf "$copy"' EXIT
trap 'exit 1' INT TERM HUP
cp -R bench clients examples scripts test "$copy/"
rm -rf "$copy"/examples/*/node_modules "$copy"/clients/*/node_modules
[ "$(id -u)" -eq 0 ] && chown -R "$RUN_AS" "$copy"
as_runner env -C "$copy" FRAMEWORKS="$FRAMEWORKS" BENCH_SECONDS="$SECONDS_A_RUN" \
	BENCH_ROUNDS="$ROUNDS" BENCH_CONNECTIONS="$CONNECTIONS" BENCH_BASELINE="${BENCH_BASELINE:-}" \
	BENCH_PORT="${BENCH_PORT:-}" \
	scripts/with-server.sh bench/http.sh --inside
