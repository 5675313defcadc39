"""Compile, never run, the GPU programs that scripts/gpu_check.py times, for a GPU described by a target spec: on a
machine without a GPU, before a lent one's minutes are spent.

jax compiles for GPUs it does not have: `jax.experimental.topologies.get_topology_desc(platform="cuda", topology=...,
target_config=<a text GpuTargetConfigProto>)` gives compile-only devices, and a program lowered with shardings on
them goes through XLA's whole GPU pipeline (Triton kernels and PTX included). Needs a jax with the CUDA plugin and
libraries (the project's CPU environment has neither; session 25 used Python 3.12 with `pip install
"jax[cuda13]==0.11.2" flax optax orbax-checkpoint pyyaml safetensors xxhash tqdm`), run with the plugin's driver
checks skipped:

    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 JAX_PLATFORMS=cpu PYTHONPATH=$PWD <that env>/bin/python \\
        scripts/gpu_compile.py --target-config scripts/gpu_specs/h200.txtpb

One JSON line per program: whether XLA's GPU compiler took it (else its error), XLA's memory analysis (temporaries,
arguments), its while loops (how many, how many with no trip count known at compile time, the largest array a loop
carries) and its custom calls (cuDNN attention, Triton kernels). What this found in session 25: the one-device
sparse path's 32,895-step loops (the 18 s step), a Triton kernel XLA refused. Nothing here times anything: a
program's speed needs the GPU (gpu_check.py). The model's platform-dependent choices ("auto", the sparse path)
resolve as on a GPU: the programs' layouts are on the compile-only GPUs (or name the platform), while the process's
default backend stays the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

def program_facts(compiled) -> dict:
    """What a compiled program holds: memory (GB), loops and custom calls, from XLA's analysis and its HLO text."""
    from sharding.hlo_collectives import array_bytes
    text = compiled.as_text()
    ma = compiled.memory_analysis()
    loops = re.findall(r"= \(([^\n]*?)\) while\(([^\n]*)", text)
    carry = max((b for shapes, _ in loops for b in array_bytes(shapes)), default=0)
    trips = [int(t) for t in re.findall(r'"known_trip_count":\{"n":"(\d+)"', text)]
    return {"temp_gb": round(ma.temp_size_in_bytes / 1e9, 3), "argument_gb": round(ma.argument_size_in_bytes / 1e9, 3),
            "while_loops": len(loops), "loops_without_known_trips": sum('known_trip_count' not in rest
                                                                     for _, rest in loops),
            "longest_known_trips": max(trips, default=0), "largest_loop_carry_gb": round(carry / 1e9, 3),
            "custom_calls": sorted(set(re.findall(r'custom_call_target="([^"]*)"', text)))}


def _compiled(name: str, build) -> None:
    t0 = time.perf_counter()
    try:
        facts = program_facts(build())
    except Exception as e:  # noqa: BLE001 - one program's failure must not hide the others'
        return print(json.dumps({"program": name, "error": f"{type(e).__name__}: {str(e)[:1500]}"}), flush=True)
    print(json.dumps({"program": name, "compile_s": round(time.perf_counter() - t0, 1), **facts}), flush=True)


def train_step(devices, options: dict, layers: int = 4, experts: int = 16, seq: int = 4096):
    """gpu_check's MFU slice (M3 widths, `layers` layers, `experts` experts, one `seq`-token row), one device."""
    from gpu_check import m3_shaped
    from m3jax.plan.compile import compile_step
    from m3jax.plan.memory import Batch
    from sharding.mesh import MeshConfig
    batch = Batch(1, seq, 1, True, platform="gpu", **options)
    return compile_step(m3_shaped(False, layers, experts), MeshConfig(1, 1, 1, 1), batch, "compact", "bfloat16", options,
                        devices=devices, return_compiled=True)["compiled"]


def forward(devices, options: dict, layers: int = 4, experts: int = 16, seq: int = 4096):
    """The same slice's logits alone (the passes that take no gradient: `sparse_attention: paged` runs there)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from gpu_check import m3_shaped
    from m3jax import M3ForCausalLM
    from sharding.mesh import MeshConfig, build_mesh
    cfg = m3_shaped(False, layers, experts)
    layout = build_mesh(MeshConfig(1, 1, 1, 1), cfg, seq_len=seq, devices=devices[:1])
    model = nnx.eval_shape(lambda: M3ForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), layout=layout, **options))
    graphdef, state = nnx.split(model)
    replicated = jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec())
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), state)
    ids = jax.ShapeDtypeStruct((1, seq), jnp.int32, sharding=replicated)
    with jax.set_mesh(layout.mesh):
        return jax.jit(lambda s, ids: nnx.merge(graphdef, s)(ids)).lower(state, ids).compile()


def decode_step(devices, options: dict, batch: int = 8, max_len: int = 4096, layers: int = 4, experts: int = 16):
    """One cached decode step of the JAX engine (`generation.backend: jax`): a token per row over `max_len` slots."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from gpu_check import m3_shaped
    from m3jax import M3ForCausalLM
    from sharding.layout import Layout
    cfg = m3_shaped(False, layers, experts)
    mesh = jax.sharding.Mesh(devices[:1], ("x",))
    on = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    # the engine's model has no mesh of its own: its layout names the platform it is built for
    model = nnx.eval_shape(lambda: M3ForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0),
                                                 layout=Layout(platform="gpu"), **options))
    graphdef, state = nnx.split(model)
    cache = jax.eval_shape(lambda: model.init_cache(batch, max_len))
    place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on)  # noqa: E731
    state, cache = jax.tree.map(place, state), jax.tree.map(place, cache)
    ids, pos = (jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=on) for _ in range(2))
    mask = jax.ShapeDtypeStruct((batch, max_len), jnp.int32, sharding=on)

    def step(state, cache, ids, pos, mask):
        return nnx.merge(graphdef, state)(ids, positions=pos, attention_mask=mask, cache=cache)

    with jax.set_mesh(mesh):
        return jax.jit(step).lower(state, cache, ids, pos, mask).compile()


def moe_kernel(devices, kernel: str, experts: int, pool: int, real_rows: int, d: int = 6144, i: int = 3072,
               tile: int = 128):  # the tiled kernel's rows per step (sharding.grouped_matmul.DEFAULT_TILE)
    """gpu_check's check 5: an expert MLP over a receive pool `pool` x its real rows, forward and backward."""
    import jax
    import jax.numpy as jnp

    from m3jax.model.moe import grouped_experts
    mesh = jax.sharding.Mesh(devices[:1], ("x",))
    on = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    n = pool * real_rows

    def loss(rows, gate_up, down, sizes, cot):
        out = grouped_experts(rows, sizes, gate_up, down, alpha=1.702, limit=7.0, kernel=kernel, backend="gpu",
                              tile=tile, expected_rows=real_rows / experts)
        return jnp.sum((out * cot).astype(jnp.float32))

    args = [jax.ShapeDtypeStruct(s, t, sharding=on) for s, t in (((n, d), jnp.bfloat16), ((experts, 2, i, d), jnp.bfloat16),
                                                                ((experts, d, i), jnp.bfloat16), ((experts,), jnp.int32),
                                                                ((n, d), jnp.bfloat16))]
    with jax.set_mesh(mesh):  # Pallas's Triton lowering reads the target GPU off the mesh's devices
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target-config", required=True, help="a text GpuTargetConfigProto, e.g. scripts/gpu_specs/h200.txtpb")
    ap.add_argument("--only", choices=("step", "forward", "decode", "moe"), action="append", help="these programs only")
    args = ap.parse_args()
    from m3jax.plan.compile import compile_only_gpus
    devices = compile_only_gpus(args.target_config, 1)
    from gpu_check import RECIPE_OPTIONS
    only = set(args.only or ("step", "forward", "decode", "moe"))
    if "moe" in only:
        for name, kernel, tile in (("ragged_dot", "ragged_dot", 128), ("tiled", "tiled", 128),
                                   ("tiled_512", "tiled", 512), ("bucketed", "bucketed", 128),
                                   ("pallas", "pallas", 128), ("mosaic", "mosaic", 128)):  # as check 5
            for experts, pool in ((1, 32), (4, 16)):
                _compiled(f"moe {name}, {experts} expert(s), pool {pool}x", lambda: moe_kernel(
                    devices, kernel, experts, pool, 4096, tile=tile))
    if "step" in only:
        for name, options in (("auto", {}), ("recipe", RECIPE_OPTIONS), ("pallas", {"moe_kernel": "pallas"}),
                              ("mosaic", {"moe_kernel": "mosaic"})):
            _compiled(f"train step, {name} options", lambda: train_step(devices, options))
    if "forward" in only:
        _compiled("forward, sparse_attention paged", lambda: forward(devices, {"sparse_attention": "paged"}))
    if "decode" in only:
        for impl in ("gather", "paged"):
            _compiled(f"decode step, sparse_attention {impl}", lambda: decode_step(devices, {"sparse_attention": impl}))


if __name__ == "__main__":
    main()
