"""`--compile`'s comparison of XLA with the plan (m3jax.plan.compile.print_compile) on made-up compile results:
the analytic side is scaled to the full depth peak by peak, and a compiled full depth is compared as it is."""

import types

from m3jax.plan.compile import print_compile
from m3jax.plan.memory import GB

# the depth of the H200 recipes, 3 full-attention dense layers + 5 sparse MoE layers (what print_compile reads of
# the model)
MODEL = types.SimpleNamespace(num_hidden_layers=8, layer_types=("full_attention",) * 3 + ("minimax_m3_sparse",) * 5,
                              mlp_layer_types=("dense",) * 3 + ("sparse",) * 5)


def made_up_result(dense: int, moe: int, xla_peak: float) -> dict:
    """One compiled depth (GB figures) whose analytic peaks are affine in the layers: the update peak
    15 + d + 2 m binds at 2+2, 3+2 and 2+3, the backward peak 10 + d + 3.5 m at 3+5 (the 128-expert H200 recipe's
    shape: the update's per-layer cost lacks the micro-batch gradient the backward's holds)."""
    phases = {"backward": (10 + dense + 3.5 * moe) * GB, "update": (15 + dense + 2 * moe) * GB}
    return {"dense": dense, "moe": moe, "peak": xla_peak * GB, "argument": 1.0 * GB, "temp": (xla_peak - 1) * GB,
            "analytic": max(phases.values()), "analytic_phases": phases, "analytic_state": 1.0 * GB,
            "lower_s": 1.0, "compile_s": 2.0, "exchange": "ragged"}


def printed(results: list, capsys) -> str:
    print_compile(types.SimpleNamespace(model=MODEL), results, 30.5 * GB, compiler="XLA:GPU")
    return capsys.readouterr().out


def test_the_per_layer_plan_is_the_peak_that_binds_at_full_depth(capsys):
    """At 2+2, 3+2 and 2+3 the update peak binds; at the full 3+5 the backward (30.5 GB against 28). The
    analytic per-layer cost beside XLA's is the backward's 3.5 GB per MoE layer, and its full depth 30.5 GB: a fit
    of the binding peak's totals read 2 GB and 28 GB (the 128-expert recipe's "11.38 GB per MoE layer" beside
    XLA's backward)."""
    out = printed([made_up_result(2, 2, 19.0), made_up_result(3, 2, 20.0), made_up_result(2, 3, 22.5)], capsys)
    assert "second kind XLA 3.5 GB vs analytic 3.5 GB (backward peak, the one binding at full depth)" in out
    assert "scaled per layer: XLA:GPU 30.5 GB vs analytic 30.5 GB" in out
    assert out.count(" update ") == 3  # the table names the peak that binds at each compiled depth


def test_a_compiled_full_depth_is_compared_without_a_fit(capsys):
    """A depth equal to the model's own (3+5) is XLA's figure for the model itself: it is printed against the plan
    even when no three depths pin down a fit."""
    out = printed([made_up_result(3, 5, 30.0)], capsys)
    assert "full depth (3+5 layers) compiled: XLA:GPU 30 GB vs analytic 30.5 GB (analytic/XLA 1.02)" in out
    assert "compile three depths" in out


def test_results_without_their_phases_fit_the_binding_total(capsys):
    """Results that carry the binding peak only (no `analytic_phases`) still scale: that total, as before."""
    results = [made_up_result(2, 2, 19.0), made_up_result(3, 2, 20.0), made_up_result(2, 3, 22.5)]
    for r in results:
        del r["analytic_phases"]
    assert "second kind XLA 3.5 GB vs analytic 2 GB\n" in printed(results, capsys)


def test_a_fourth_depth_shows_how_far_the_compiled_peaks_lie_off_the_fit(capsys):
    """Three depths fit exactly, whatever one of them does; a fourth measures the trend (the 128-expert recipe's
    2+2 peaks 1.55 GB below the line through 2+3 and 2+4)."""
    depths = [made_up_result(2, 2, 19.0), made_up_result(3, 2, 20.0), made_up_result(2, 4, 26.0)]
    assert "off XLA's fit" not in printed(depths, capsys)
    out = printed(depths + [made_up_result(2, 3, 22.5 + 0.9)], capsys)
    assert "(the compiled depths lie up to 0.6 GB off XLA's fit)" in out
