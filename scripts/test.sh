#!/usr/bin/env bash
# The test suite, as README and CI run it: build/refresh the environment, then pytest on CPU.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
./scripts/setup.sh
exec .venv/bin/python -m pytest tests "$@"
