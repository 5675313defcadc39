#!/usr/bin/env bash
# The test suite, as README and CI run it: build/refresh the environment, then pytest on CPU.
#   ./scripts/test.sh            the default run (CI's): every test but `extended`, in two phases
#   ./scripts/test.sh ARGS...    pytest ARGS (one file, -k, -m ...), in one process unless ARGS say -n
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
./scripts/setup.sh
py="${M3JAX_VENV:-$root/.venv}/bin/python"  # the environment setup.sh built (M3JAX_VENV: elsewhere)
if [ "$#" -gt 0 ]; then
  # pyproject.toml's testpaths names tests/ when no path is given; prepending "tests" here made
  # `./scripts/test.sh tests/test_x.py` run the whole suite.
  exec "$py" -m pytest "$@"
fi
# Phase 1 on both cores (pytest-xdist; a module stays in one worker, so its fixtures are built once): a
# test process mostly compiles on one core, so two workers finish the bulk in ~60 % of the time.
# Phase 2 alone: the `serial` modules, real vLLM engines in Ray actors or worker processes, which hold
# gigabytes each and answer within request timeouts that a second worker's load would stretch (the niced process
# below takes a core only where nothing else wants it).
status=0
# The `xla_defaults` tests (bit-for-bit comparisons of two programs) compile with XLA's defaults, not with the faster
# flags of tests/conftest.py that phase 1 compiles with, so they run in a process of their own: beside both phases,
# at the lowest CPU priority, on the CPU time the phases leave idle (a worker's last module, the subprocesses'
# start-ups, the vLLM engines' waits). In phase 2 they took ~55 s of their own. Their output follows phase 2's.
xla_log="$(mktemp)"
nice -n 19 "$py" -m pytest -p no:cacheprovider -m "xla_defaults and not serial and not extended" \
  >"$xla_log" 2>&1 &
xla_pid=$!
trap 'kill "$xla_pid" 2>/dev/null || true; rm -f "$xla_log"' EXIT
# --no-loadscope-reorder: xdist would otherwise hand out the modules with the most tests first, undoing
# tests/conftest.py's FIRST (the longest modules first, so no worker is left with one of them at the end).
"$py" -m pytest -n 2 --dist loadfile --no-loadscope-reorder -m "not extended and not serial and not xla_defaults" || status=$?
"$py" -m pytest -m "serial and not extended" || status=$((status ? status : $?))
xla_status=0
wait "$xla_pid" || xla_status=$?
cat "$xla_log"
exit $((status ? status : xla_status))
