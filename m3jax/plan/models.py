"""Built-in model shapes for planning without a checkpoint."""

from m3jax.config import M3Config
from m3jax.presets import release_fields


def m3_release(num_dense: int = 3, num_moe: int = 57) -> M3Config:
    """MiniMax-M3's text model with the released values (`m3jax.presets.release_fields`): layers 0..2 full attention
    + dense MLP, 3..59 indexer sparse attention + MoE. `num_dense` / `num_moe` give the reduced-depth variants the
    compile check uses (real widths)."""
    return M3Config(**release_fields(num_dense, num_moe))
