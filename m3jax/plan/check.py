"""Sharding-type check on an AbstractMesh: no devices, any device count, the full-depth model.

What a run would trip over before its first step, found without a cluster:
- the mesh rules (`sharding.mesh.validate`);
- every parameter, optimizer-state and batch array against its NamedSharding: JAX's own
  `shard_shape` refuses a dimension its mesh axes do not divide, as jit would;
- every logical axis name the model and the step use has a row in the rules table (tracing the
  step resolves each one; `sharding.rules.mesh_axes_of` refuses unknown names);
- the whole train step traces and lowers for GPU on that mesh (shard_map specs, collectives),
  without compiling (an abstract mesh cannot compile).
It also sums the per-device bytes of the train state from the shard shapes: exact, to set next to
the analytic plan's state terms.
"""

from __future__ import annotations

import time

from m3jax.config import M3Config
from sharding.mesh import MeshConfig, MeshError, validate
from m3jax.plan.memory import Batch


def abstract_train_state(cfg: M3Config, master: str, moment_dtype: str, remat: bool = True,
                         model_options: dict | None = None, layout=None):
    """(graphdef, optimizer, TrainState of ShapeDtypeStructs): the model (M3ForCausalLM keywords
    `model_options`) on `layout` and its optimizer state by shape only."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from m3jax.model.decoder import M3ForCausalLM
    from sharding import optim_step, precision
    from sharding.train_step import TrainState

    opt = optim_step.adamw(1e-6, moment_dtype=jnp.dtype(moment_dtype), master=master)
    abstract = nnx.eval_shape(lambda: M3ForCausalLM(cfg, dtype=precision.param_dtype(master), rngs=nnx.Rngs(0),
                                                    remat=remat, layout=layout, **(model_options or {})))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    return graphdef, opt, TrainState(params, rest, jax.eval_shape(opt.init, params), scalar, scalar)


def abstract_batch(layout, mesh_cfg: MeshConfig, batch: Batch) -> dict:
    """The cross-entropy batch [micro-batches, rows, seq] as ShapeDtypeStructs on `layout` (concrete or
    abstract mesh)."""
    import jax
    import jax.numpy as jnp

    from sharding.train_step import batch_sharding
    shape = (batch.num_micro, batch.micro_batch * mesh_cfg.data * mesh_cfg.expert, batch.seq_len)
    return {k: jax.ShapeDtypeStruct(shape, dt, sharding=batch_sharding(layout))
            for k, dt in (("input_ids", jnp.int32), ("targets", jnp.int32), ("loss_mask", jnp.float32))}


def abstract_layout(mesh_cfg: MeshConfig):
    """The run's layout on an AbstractMesh of `mesh_cfg`'s shape: traces and lowers, never compiles. The layout
    `sharding.mesh.build_mesh` gives the run, step copy (fsdp_step_axes) and context balance included: without
    them the check lowered another step than the one the run executes."""
    import jax
    from jax.sharding import AxisType

    from sharding.layout import Layout
    from sharding.rules import MESH_AXES
    mesh = jax.sharding.AbstractMesh(mesh_cfg.shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    return Layout(mesh, mesh_cfg.rules, tuple(mesh_cfg.fsdp_step_axes), context_balance=mesh_cfg.context_balance)


def indivisible(state, shardings) -> list[str]:
    """'<path>: <jax's message>' for every array whose sharding does not divide its shape."""
    import jax
    problems = []
    for (path, leaf), sh in zip(jax.tree.leaves_with_path(state), jax.tree.leaves(shardings)):
        try:
            sh.shard_shape(leaf.shape)
        except ValueError as e:
            problems.append(f"{jax.tree_util.keystr(path)}: {str(e).split(' (full shape')[0]}")
    return problems


def state_bytes_per_device(state, shardings) -> float:
    import math

    import jax
    return float(sum(math.prod(sh.shard_shape(leaf.shape)) * leaf.dtype.itemsize
                     for leaf, sh in zip(jax.tree.leaves(state), jax.tree.leaves(shardings))))


def check_shardings(cfg: M3Config, mesh_cfg: MeshConfig, batch: Batch, master: str = "fp32",
                    moment_dtype: str = "float32", lower: bool = True, state=None,
                    model_options: dict | None = None) -> dict:
    """Problems (empty list = none) of `cfg` on an abstract `mesh_cfg`, the number of arrays checked, the
    exact per-device train-state bytes and the trace+lower time. `state`: a prebuilt
    `abstract_train_state(...)` to reuse across meshes (its shapes; the lowered model is built on this mesh)."""
    import jax

    from sharding.train_step import make_train_step, state_shardings

    t0 = time.perf_counter()
    rows = batch.micro_batch * mesh_cfg.data * mesh_cfg.expert
    problems = []
    try:
        validate(mesh_cfg, cfg, seq_len=batch.seq_len, batch=rows)
    except MeshError as e:
        problems.append(f"mesh rules: {e}")
    except KeyError as e:  # a parameter's logical name without a rules row
        problems.append(f"rules: {e.args[0]}")
    # Lowered for cuda, so the expert exchange is the one a GPU runs (the CPU default is the padded one).
    model_options = {"moe_exchange": "ragged", **(model_options or {})}
    layout = abstract_layout(mesh_cfg)
    if state is not None and lower:
        state = None  # the lowered model carries this mesh's layout
    graphdef, opt, abstract = state or abstract_train_state(cfg, master, moment_dtype, batch.remat, model_options,
                                                            layout)
    out = {"arrays": 0, "state_bytes": None, "lowered": False, "problems": problems}
    try:
        shardings = state_shardings(layout, abstract)
    except KeyError as e:  # a parameter's logical name without a rules row
        problems.append(f"rules: {e.args[0]}")
        return out
    b = abstract_batch(layout, mesh_cfg, batch)
    bad = indivisible(abstract, shardings) + indivisible(b, {k: v.sharding for k, v in b.items()})
    problems += bad
    out["arrays"] = len(jax.tree.leaves(abstract)) + len(b)
    if bad:
        return out
    out["state_bytes"] = state_bytes_per_device(abstract, shardings)
    if lower:
        st = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
        step = make_train_step(graphdef, opt, mesh=layout, shardings=shardings)
        try:
            with jax.sharding.use_abstract_mesh(layout.mesh):
                step.jitted.trace(st, b).lower(lowering_platforms=("cuda",))
            out["lowered"] = True
        except Exception as e:  # noqa: BLE001 - whatever tracing or lowering raises is the finding
            problems.append(f"train step does not lower: {type(e).__name__}: {str(e)[:500]}")
    out["check_s"] = time.perf_counter() - t0
    return out


def print_check(job) -> int:
    """CLI report of `check_shardings` for a planner Job; the exit status is 1 on any problem."""
    from m3jax.plan.memory import GB, memory_plan
    m = job.mesh
    r = check_shardings(job.model, m, job.batch, job.master, job.moment_dtype, model_options=job.model_options)
    print(f"sharding check on an AbstractMesh data={m.data} context={m.context} expert={m.expert} tensor={m.tensor} "
          f"({m.num_devices} devices, EP {m.expert_parallel} over {','.join(m.expert_axes)}), "
          f"{job.model.num_hidden_layers} layers:")
    for p in r["problems"]:
        print(f"  PROBLEM {p}")
    if r["problems"]:
        return 1
    plan = memory_plan(job.model, m, job.batch, job.master, job.moment_dtype)
    analytic = sum(plan.get(k, 0.0) for k in ("params", "master", "moments", "buffers"))
    print(f"  {r['arrays']} arrays divide evenly; every logical axis resolves; the train step traces and lowers "
          f"for cuda ({r['check_s']:.1f} s)")
    print(f"  train state per device: {r['state_bytes'] / GB:.3f} GB from the shard shapes, "
          f"{analytic / GB:.3f} GB in the analytic plan")
    return 0
