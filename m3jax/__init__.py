"""m3jax: MiniMax-M3 in JAX / Flax NNX.

Public API: `M3Config`, `M3ForCausalLM`, `from_pretrained`, `save_pretrained`.
"""

from m3jax.config import ConfigError, M3Config
from m3jax.hf.load import from_pretrained
from m3jax.hf.safetensors_io import CheckpointError
from m3jax.hf.save import save_pretrained
from m3jax.model.decoder import M3ForCausalLM
from sharding.mesh import MeshError

__all__ = ["M3Config", "M3ForCausalLM", "from_pretrained", "save_pretrained", "ConfigError", "CheckpointError", "MeshError"]
