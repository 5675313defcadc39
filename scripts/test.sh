#!/usr/bin/env bash
# The test suite, as README and CI run it: build/refresh the environment, then pytest on CPU.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
./scripts/setup.sh
# pyproject.toml's testpaths names tests/ when no path is given; prepending "tests" here made
# `./scripts/test.sh tests/test_x.py` run the whole suite.
exec .venv/bin/python -m pytest "$@"
