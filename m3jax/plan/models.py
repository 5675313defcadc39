"""Built-in model shapes for planning without a checkpoint."""

from m3jax.config import DENSE_MLP, FULL_ATTENTION, MOE_MLP, SPARSE_ATTENTION, M3Config


def m3_release(num_dense: int = 3, num_moe: int = 57) -> M3Config:
    """MiniMax-M3 text model with the released values (../shared/docs/m3-architecture.md §1): layers
    0..2 full attention + dense MLP, 3..59 indexer sparse attention + MoE. `num_dense` / `num_moe`
    give the reduced-depth variants the compile check uses (real widths)."""
    n = num_dense + num_moe
    return M3Config(
        vocab_size=200064, hidden_size=6144, num_hidden_layers=n, num_attention_heads=64, num_key_value_heads=4,
        head_dim=128, intermediate_size=3072, dense_intermediate_size=12288, shared_intermediate_size=3072,
        num_local_experts=128, num_experts_per_tok=4,
        layer_types=[FULL_ATTENTION] * num_dense + [SPARSE_ATTENTION] * num_moe,
        mlp_layer_types=[DENSE_MLP] * num_dense + [MOE_MLP] * num_moe,
        rope_theta=5_000_000.0, partial_rotary_factor=0.5, rms_norm_eps=1e-6, routed_scaling_factor=2.0,
        index_n_heads=4, index_head_dim=128, index_block_size=128, index_topk_blocks=16, index_local_blocks=1,
        max_position_embeddings=1048576)
