"""Child process of `m3jax.plan.compile.compile_reduced` (XLA_FLAGS already set by the parent).
Reads the job as JSON on stdin, prints one JSON list: XLA and analytic memory per reduced depth."""

import dataclasses
import json
import sys

from m3jax.config import M3Config
from sharding.mesh import MeshConfig
from m3jax.plan.compile import compile_only_gpus, compile_step
from m3jax.plan.memory import Batch, memory_phases

STATE_TERMS = ("params", "master", "moments", "buffers")  # what XLA counts as arguments (besides the batch)


def reduced(cfg: M3Config, n_dense: int, n_moe: int) -> M3Config:
    """First n_dense layers of the first kind and n_moe of the last kind, real widths."""
    first, last = (cfg.layer_types[0], cfg.mlp_layer_types[0]), (cfg.layer_types[-1], cfg.mlp_layer_types[-1])
    kinds = [first] * n_dense + [last] * n_moe if first != last else [first] * (n_dense + n_moe)
    return dataclasses.replace(cfg, num_hidden_layers=len(kinds), layer_types=tuple(k[0] for k in kinds),
                               mlp_layer_types=tuple(k[1] for k in kinds))


def main():
    spec = json.loads(sys.stdin.read())
    m = spec["model"]
    cfg = M3Config(**{**m, "eos_token_id": tuple(m["eos_token_id"]) if isinstance(m["eos_token_id"], list)
                      else m["eos_token_id"]})
    mesh = MeshConfig(**{**spec["mesh"], **{k: tuple(spec["mesh"][k]) for k in ("expert_axes", "fsdp_axes",
                                                                                 "fsdp_step_axes")
                                              if k in spec["mesh"]}})
    devices, act_bytes, platform = None, 4, None
    if spec.get("target_config"):  # the model's layout is on these devices: its choices are a GPU's
        devices, act_bytes, platform = compile_only_gpus(spec["target_config"], mesh.num_devices), 2, "gpu"
    # The analytic side as the compiler runs the model: the exchange its platform picks (padded on CPU, ragged on a
    # GPU) unless the options name one, and on CPU fp32-sized activations (XLA:CPU computes bf16 arithmetic in fp32).
    batch = Batch(spec["micro_batch"], spec["seq_len"], spec.get("num_micro", 1), spec["remat"], platform=platform,
                  **(spec.get("model_options") or {}))
    out = []
    for n_dense, n_moe in spec["layer_sets"]:
        c = reduced(cfg, n_dense, n_moe)
        r = compile_step(c, mesh, batch, spec["master"], spec["moment_dtype"], spec.get("model_options"),
                         devices=devices)
        phases = memory_phases(c, mesh, batch, spec["master"], spec["moment_dtype"], act_bytes=act_bytes)
        plan = max(phases.values(), key=lambda terms: terms["total"])  # `memory_plan`: the binding peak
        r.update(dense=n_dense, moe=n_moe, analytic=plan["total"], exchange=batch.exchange,
                 analytic_phases={name: terms["total"] for name, terms in phases.items()},
                 analytic_state=sum(plan.get(k, 0.0) for k in STATE_TERMS))
        out.append(r)
        print(f"compiled {n_dense}+{n_moe} layers on {r['devices']} devices: lower {r['lower_s']:.0f} s, "
              f"total {r['compile_s']:.0f} s", file=sys.stderr, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
