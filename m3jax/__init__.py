"""m3jax: MiniMax-M3 in JAX / Flax NNX.

Public API: `M3Config`, `M3ForCausalLM`, `from_pretrained`, `save_pretrained`, and the errors they raise
(`ConfigError`, `CheckpointError`, `MeshError`). Names load on first use, so that `python -m m3jax.<command>`
can check its arguments (and a run its directory lock) before jax is imported.
"""

import importlib

_EXPORTS = {
    "M3Config": "m3jax.config", "ConfigError": "m3jax.config",
    "from_pretrained": "m3jax.hf.load", "save_pretrained": "m3jax.hf.save",
    "CheckpointError": "m3jax.hf.safetensors_io", "M3ForCausalLM": "m3jax.model.decoder",
    "MeshError": "sharding.mesh",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'm3jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
