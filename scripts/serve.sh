#!/usr/bin/env bash
# Quick start, part 1: install what is missing, build, and start kvbankd on 127.0.0.1:50051 with
# the host-memory pool. Extra arguments go to kvbankd (e.g. --pool-bytes 4GiB).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake --preset release >/dev/null
cmake --build --preset release --target kvbankd kvbank_cli
# --no-auth: a local development server. Production: --auth-tokens-file (see README).
exec build/release/bin/kvbankd --listen 127.0.0.1:50051 --no-auth "$@"
