#!/usr/bin/env bash
# The test suite, as README and CI run it: build/refresh the environment, then pytest on CPU.
#   ./scripts/test.sh            the default run (CI's): every test but `extended`, in two phases
#   ./scripts/test.sh ARGS...    pytest ARGS (one file, -k, -m ...), in one process unless ARGS say -n
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
./scripts/setup.sh
if [ "$#" -gt 0 ]; then
  # pyproject.toml's testpaths names tests/ when no path is given; prepending "tests" here made
  # `./scripts/test.sh tests/test_x.py` run the whole suite.
  exec .venv/bin/python -m pytest "$@"
fi
# Phase 1 on both cores (pytest-xdist; a module stays in one worker, so its fixtures are built once): a
# test process mostly compiles on one core, so two workers finish the bulk in ~60 % of the time.
# Phase 2 alone: the `serial` modules, real vLLM engines in Ray actors or worker processes, which hold
# gigabytes each and answer within request timeouts that a second worker's load would stretch.
status=0
# --no-loadscope-reorder: xdist would otherwise hand out the modules with the most tests first, undoing
# tests/conftest.py's FIRST (the longest modules first, so no worker is left with one of them at the end).
# The `xla_defaults` tests (bit-for-bit comparisons of two programs) join phase 2, so that phase 1 compiles with
# the faster flags of tests/conftest.py and they with XLA's defaults.
.venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder -m "not extended and not serial and not xla_defaults" || status=$?
.venv/bin/python -m pytest -m "(serial or xla_defaults) and not extended" || status=$((status ? status : $?))
exit "$status"
