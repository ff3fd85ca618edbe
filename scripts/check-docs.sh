#!/usr/bin/env bash
#
# make check-docs (SUITES=docs make test): every SQL example of README.md
# and doc/**/*.md runs, against a temporary server that preloads the
# library (scripts/with-server.sh).
#
# Each Markdown file gets a database of its own, created afresh with CREATE
# EXTENSION idempotency; its blocks run there in the order they appear, each
# in a psql session of its own with ON_ERROR_STOP=1.  So a block may build
# on the rows and objects of the blocks above it, but not on their SET or on
# a transaction they left open.  The first error fails the file, reported as
# the file, the block's number and line, and psql's error.  In the Markdown:
#
#   ```sql              run.
#   <!-- docs-setup     SQL run at that point that the page does not show
#   ...                 (the tables, schemas and roles an example needs);
#   -->                 the comment may also close on its first line.  Roles
#                       belong to the cluster, which every file shares:
#                       create them so that a second CREATE does not fail
#                       (a DO block that ignores duplicate_object).
#   <!-- docs-skip: why -->
#                       on the line just before a ```sql block: that block
#                       is not run.  Say why, and what tests it instead.
#   any other info string (```text for signatures, results and errors,
#                       ```sh, ```ini, ```properties, ```json, ```python,
#                       ```js): not run.
#
# Results shown in comments or in ```text blocks are not compared: the
# examples that show them must show what they print.
#
# As root, it runs as the runner in a scratch copy of the tree, as
# scripts/test.sh does (initdb refuses root); as anyone else, in this tree,
# which it must be able to write (./tmp_check_server, ./tmp_check_docs).
#
#   scripts/check-docs.sh --with-server
#
# runs the files against the server that PGHOST, PGPORT and PGUSER (a
# superuser) name: that is how with-server.sh calls it.  It drops and
# creates a database docs_<file> per file, dropped again once the file
# passes.  DOCS=README.md (paths, space-separated) checks only those files.
#
set -uo pipefail
cd "$(dirname "$0")/.."

. scripts/common.sh

# The blocks of one Markdown file, into $2: NNN.sql per block to run, and a
# manifest of "NNN kind block line reason" lines (kind: sql, setup or skip;
# block: the number of the ```sql block; line: the file's line where the
# block's SQL begins).
extract_blocks() {
	awk -v dir="$2" '
		function open_unit(kind, start, reason) {
			seq++
			file = sprintf("%s/%03d.sql", dir, seq)
			printf "%03d %s %d %d %s\n", seq, kind, sqlblocks, start, reason >> (dir "/manifest")
			if (kind != "skip")
				printf "" > file
		}
		in_setup {
			if (index($0, "-->") > 0) {
				text = $0
				sub(/-->.*/, "", text)
				print text > file
				close(file)
				in_setup = 0
			} else
				print > file
			next
		}
		in_fence {
			if ($0 ~ /^[ \t]*```[ \t]*$/) {
				if (capture)
					close(file)
				in_fence = capture = 0
			} else if (capture)
				print > file
			next
		}
		/^[ \t]*<!-- docs-skip:/ {
			skip = $0
			sub(/^[ \t]*<!-- docs-skip:[ \t]*/, "", skip)
			sub(/[ \t]*-->.*$/, "", skip)
			if (skip == "")
				skip = "(no reason given)"
			next
		}
		/^[ \t]*<!-- docs-setup/ {
			text = $0
			sub(/^[ \t]*<!-- docs-setup:?/, "", text)
			if (index(text, "-->") > 0) {
				open_unit("setup", FNR, "")
				sub(/-->.*/, "", text)
				print text > file
				close(file)
			} else {
				open_unit("setup", FNR + 1, "")
				in_setup = 1
			}
			skip = ""
			next
		}
		/^[ \t]*```/ {
			info = $0
			sub(/^[ \t]*```[ \t]*/, "", info)
			sub(/[ \t]+$/, "", info)
			in_fence = 1
			capture = 0
			if (info == "sql") {
				sqlblocks++
				open_unit(skip != "" ? "skip" : "sql", FNR + 1, skip)
				capture = skip == ""
			}
			skip = ""
			next
		}
		/[^ \t]/ { skip = "" }
		END {
			if (in_fence || in_setup) {
				printf "%s: a %s is not closed\n", FILENAME, in_fence ? "code block" : "docs-setup comment" > "/dev/stderr"
				exit 1
			}
		}' "$1"
}

# psql's "psql:/path/NNN.sql:L: ERROR: ..." as "file:line: ERROR: ..."
locate_errors() {
	local block_file=$1 doc=$2 start=$3
	awk -v f="psql:$block_file:" -v doc="$doc" -v start="$start" '
		index($0, f) == 1 {
			rest = substr($0, length(f) + 1)
			n = rest
			sub(/:.*/, "", n)
			sub(/^[0-9]+:/, "", rest)
			printf "%s:%d:%s\n", doc, start + n - 1, rest
			next
		}
		{ print }'
}

if [ "${1:-}" = --with-server ]; then
	# ---- inside scripts/with-server.sh: PGHOST, PGPORT, PGUSER are set ----
	use_server
	admin() {
		"$PGBIN/psql" -X -q -v ON_ERROR_STOP=1 -d postgres \
			-c "SET client_min_messages = warning" "$@" >/dev/null
	}
	scratch=$PWD/tmp_check_docs
	rm -rf "$scratch"
	mkdir -p "$scratch"
	if [ -n "${DOCS:-}" ]; then
		read -r -a docs <<<"$DOCS"
	else
		mapfile -t docs < <(echo README.md; find doc -name '*.md' 2>/dev/null | LC_ALL=C sort)
	fi

	status=0
	for doc in "${docs[@]}"; do
		[ -f "$doc" ] || { echo "FAILED: $doc: no such file"; status=1; continue; }
		dir=$scratch/$(echo "$doc" | tr '/.' '__')
		mkdir -p "$dir"
		: >"$dir/manifest"
		extract_blocks "$doc" "$dir" || { echo "FAILED: $doc"; status=1; continue; }
		db=docs_$(echo "${doc%.md}" | tr 'A-Z' 'a-z' | tr -c 'a-z0-9\n' '_')
		admin -c "DROP DATABASE IF EXISTS $db WITH (FORCE)" -c "CREATE DATABASE $db" &&
			"$PGBIN/psql" -X -q -v ON_ERROR_STOP=1 -d "$db" \
				-c "CREATE EXTENSION idempotency" >/dev/null || exit 1

		ran=0
		skipped=0
		failed=
		while read -r seq kind block line reason; do
			case $kind in
			skip)
				skipped=$((skipped + 1))
				echo "   $doc: sql block $block (line $line) not run: $reason"
				continue
				;;
			setup) what="the docs-setup at line $line" ;;
			*) what="sql block $block (line $line)" ;;
			esac
			# a statement that waits for ever fails instead
			if ! err=$(PGOPTIONS="-c statement_timeout=60s" "$PGBIN/psql" -X -q \
				-v ON_ERROR_STOP=1 -d "$db" -f "$dir/$seq.sql" 2>&1 >/dev/null); then
				echo "FAILED: $doc, $what:"
				printf '%s\n' "$err" | locate_errors "$dir/$seq.sql" "$doc" "$line" | sed 's/^/    /'
				failed=1
				break
			fi
			[ "$kind" = sql ] && ran=$((ran + 1))
		done <"$dir/manifest"

		if [ -n "$failed" ]; then
			status=1
			echo "   (database $db kept, with what the blocks before it did)"
		else
			blocks="$ran sql blocks"
			[ "$ran" -eq 1 ] && blocks="1 sql block"
			echo "ok: $doc ($blocks run, $skipped not run)"
			admin -c "DROP DATABASE $db WITH (FORCE)" || exit 1
		fi
	done
	exit $status
fi

# ---- outside: the server ----
if [ "$(id -u)" -eq 0 ]; then
	# initdb refuses root: run as the runner, in a copy of the tree it owns
	use_server
	work=$(runner_tmpdir docs)
	trap 'rm -rf "$work"' EXIT
	tar --exclude=./.git --exclude='./tmp_check*' --exclude=node_modules -cf - . |
		tar -C "$work" -xf -
	chown -R "$RUN_AS" "$work"
	as_runner env PG_CONFIG="$PG_CONFIG" DOCS="${DOCS:-}" "$work/scripts/check-docs.sh"
	exit $?
fi

exec scripts/with-server.sh "$PWD/scripts/check-docs.sh" --with-server
