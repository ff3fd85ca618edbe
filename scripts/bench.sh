#!/usr/bin/env bash
#
# make bench: install what is missing, build and install the extension, and
# run bench/run.py (a throwaway cluster; about 12 minutes).  Not part of
# make test: timing is never a test.
#
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/deps.sh
. scripts/common.sh
build_and_install
exec python3 bench/run.py
