"""XLA:CPU temporaries of the optimizer step: the whole-tree optax update vs `sharding.optim_step`'s
in-place update layer slice by layer slice (the constants of `m3jax.plan.memory.update_temporaries`).

    .venv/bin/python scripts/bench_update_memory.py

An M3-shaped model (hidden 512, 2 dense + N MoE layers of 8 experts) is built by shape only; the step's
tail (global norm, update, non-finite select) is compiled from ShapeDtypeStructs with the state donated,
and `memory_analysis().temp_size_in_bytes` is read. Prints one JSON line per row.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from m3jax.config import M3Config
from m3jax.model.decoder import M3ForCausalLM
from sharding import optim_step, precision
from sharding.train_step import TrainState


def model(vocab: int, n_moe: int) -> M3Config:
    return M3Config(vocab_size=vocab, hidden_size=512, num_hidden_layers=2 + n_moe, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, intermediate_size=256, dense_intermediate_size=1024,
                    shared_intermediate_size=256, num_local_experts=8, num_experts_per_tok=2,
                    layer_types=["full_attention"] * 2 + ["minimax_m3_sparse"] * n_moe,
                    mlp_layer_types=["dense"] * 2 + ["sparse"] * n_moe, partial_rotary_factor=0.5,
                    index_n_heads=2, index_head_dim=32, index_block_size=16, index_topk_blocks=2)


def temp_bytes(cfg: M3Config, master: str, moments: str, sliced: bool) -> tuple[float, int]:
    opt = optim_step.adamw(1e-6, moment_dtype=jnp.dtype(moments), master=master, weight_decay=0.1)
    abstract = nnx.eval_shape(lambda: M3ForCausalLM(cfg, dtype=precision.param_dtype(master), rngs=nnx.Rngs(0)))
    _, params, rest = nnx.split(abstract, nnx.Param, ...)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    state = TrainState(params, rest, jax.eval_shape(opt.init, params), scalar, scalar)
    grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), params)

    def tail(state, grads):
        finite = jnp.isfinite(optax.tree.norm(grads))
        if sliced:
            p, o = opt.step(grads, 3.0, state.opt_state, state.params, finite)
            return TrainState(p, state.rest, o, state.step + 1, state.skipped)
        grads = jax.tree.map(lambda g: g / 3.0, grads)
        updates, o = opt.update(grads, state.opt_state, state.params)
        new = TrainState(precision.apply(state.params, updates, o), state.rest, o, state.step + 1, state.skipped)
        return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, state)

    compiled = jax.jit(tail, donate_argnums=(0,)).lower(state, grads).compile()
    return float(compiled.memory_analysis().temp_size_in_bytes), sum(x.size for x in jax.tree.leaves(params))


def main():
    modes = [("compact", "bfloat16"), ("fp32", "bfloat16"), ("fp32", "float32"), ("none", "float32")]
    for master, moments in modes:
        whole, n = temp_bytes(model(256, 4), master, moments, sliced=False)
        sliced = {m: temp_bytes(model(256, m), master, moments, sliced=True)[0] for m in (4, 8)}
        big_vocab, n_big = temp_bytes(model(16384, 4), master, moments, sliced=True)
        print(json.dumps({"master": master, "moments": moments, "params": n,
                          "whole_tree_temp_bytes_per_param": round(whole / n, 2),
                          "sliced_temp_MB_4_moe_layers": round(sliced[4] / 1e6, 1),
                          "sliced_temp_MB_8_moe_layers": round(sliced[8] / 1e6, 1),
                          "largest_layer_slice_elems": 8 * 2 * 256 * 512,
                          "whole_leaf_bytes_per_elem": round((big_vocab - sliced[4]) / (n_big - n), 2)}), flush=True)


if __name__ == "__main__":
    main()
