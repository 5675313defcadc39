"""The planner's step time under contiguous context shards: the step waits for the busiest shard, which holds
(2n - 1) / n times the average of the full layers' causal flash work; mirrored shards (`mesh.context_balance`,
the default, `sharding.context`) split it evenly."""

import contextlib
import io

import pytest

from m3jax.config import FULL_ATTENTION
from m3jax.plan.flops import causal_pairs, context_imbalance, step_flops
from m3jax.plan.remat import small_config
from sharding.mesh import MeshConfig


@pytest.mark.parametrize("context, balance, want", [(1, False, 1.0), (2, True, 1.0), (2, False, 1.5),
                                                    (8, False, 15 / 8), (8, True, 1.0)])
def test_busiest_context_shard(context, balance, want):
    assert context_imbalance(MeshConfig(context=context, context_balance=balance)) == want


def test_busiest_contiguous_shard_by_brute_force():
    """Shard c of n contiguous shards holds queries [c L, (c+1) L), each seeing its causal keys."""
    s, n = 4096, 8
    per_shard = [sum(i + 1 for i in range(c * s // n, (c + 1) * s // n)) for c in range(n)]
    assert max(per_shard) / (sum(per_shard) / n) == pytest.approx(context_imbalance(MeshConfig(context=n,
                                                                                               context_balance=False)),
                                                                 rel=2 / (s // n))


def test_full_flash_work_is_counted_apart():
    cfg = small_config(2)
    flash = step_flops(cfg, 4, 512, remat=True, attention="flash")
    n_full = sum(t == FULL_ATTENTION for t in cfg.layer_types)
    assert n_full > 0
    pairs = n_full * (causal_pairs(512) + 512 * 128 // 2) * 4
    h_d = cfg.num_attention_heads * cfg.head_dim
    assert flash["full_flash_executed"] == 18 * h_d * pairs and flash["full_flash_forward"] == 4 * h_d * pairs
    assert flash["full_flash_executed"] < flash["attention_executed"]
    assert step_flops(cfg, 4, 512, remat=True, attention="dense")["full_flash_executed"] == 0  # static work
    no_remat = step_flops(cfg, 4, 512, remat=False, attention="flash")
    assert no_remat["full_flash_executed"] == 14 * h_d * pairs


def test_the_plan_charges_contiguous_shards():
    from m3jax.plan.__main__ import main
    recipe = ["--config", "configs/recipes/m3-32node.yaml", "--model", "release"]
    out = {}
    for balance in ("true", "false"):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            main(recipe + [f"mesh.context_balance={balance}"])
        out[balance] = buf.getvalue()
    step = {k: float(v.split("step time estimate: ")[1].split(" s")[0]) for k, v in out.items()}
    assert step["false"] > step["true"]
    assert "the busiest does 1.88x the average of the full layers' flash" in out["false"]
    assert "contiguous context shards" not in out["true"]
