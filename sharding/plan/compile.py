"""XLA's view: compile the real train step from shape-only inputs on (simulated) devices.

Needs as many jax devices as the mesh: on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N
*before* jax is imported (`python -m sharding.plan --compile` re-executes itself to do so). Nothing is
allocated: the model and optimizer state are `jax.eval_shape`d, the batch is ShapeDtypeStructs.
"""

from __future__ import annotations

import time

from m3jax.config import M3Config
from sharding.mesh import MeshConfig
from sharding.plan.memory import Batch


def compile_step(cfg: M3Config, mesh_cfg: MeshConfig, batch: Batch, master: str = "fp32",
                 moment_dtype: str = "float32") -> dict:
    """Lower and compile `make_train_step` (token cross-entropy loss) on a mesh of the first devices;
    returns XLA's per-device memory_analysis (bytes) and the compile time.

        peak = argument + output - alias + temp   (donated state: outputs alias the arguments)
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from m3jax.model.decoder import M3ForCausalLM
    from sharding import precision
    from sharding.mesh import build_mesh
    from sharding.rules import logical_to_spec, rules_for, use_rules
    from sharding.train_step import TrainState, make_train_step, state_shardings

    n = mesh_cfg.num_devices
    t0 = time.perf_counter()
    with use_rules(rules_for(mesh_cfg.expert_axes)):
        mesh = build_mesh(mesh_cfg, cfg, seq_len=batch.seq_len, devices=jax.devices()[:n])
        dtype = precision.param_dtype(master)
        opt = precision.adamw(1e-6, moment_dtype=jnp.dtype(moment_dtype), master=master)
        abstract = nnx.eval_shape(lambda: M3ForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0), remat=batch.remat))
        graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
        state = TrainState(params, rest, jax.eval_shape(opt.init, params), jax.ShapeDtypeStruct((), jnp.int32),
                           jax.ShapeDtypeStruct((), jnp.int32))
        shardings = state_shardings(mesh, state)
        step = make_train_step(graphdef, opt, mesh=mesh, shardings=shardings)
        rows = batch.micro_batch * mesh_cfg.data * mesh_cfg.expert
        spec = P(None, *logical_to_spec(("act_batch", "act_seq")))
        shape = (batch.num_micro, rows, batch.seq_len)
        sds = lambda dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))  # noqa: E731
        b = {"input_ids": sds(jnp.int32), "targets": sds(jnp.int32), "loss_mask": sds(jnp.float32)}
        with jax.set_mesh(mesh):
            compiled = step.jitted.lower(state, b).compile()
    ma = compiled.memory_analysis()
    out = {k: float(getattr(ma, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp",
                                                                  "generated_code")}
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    out["compile_s"] = time.perf_counter() - t0
    out["devices"] = n
    return out
