"""scripts/gpu_check.py is run only when a GPU is lent, in one go: its checks must not break unseen on CPU.

Each kernel of its attention check runs inside a try (cuDNN raises off a GPU), so a renamed argument there would
only surface as an "error" entry in the GPU run's output; this runs the check at a small shape here and requires
every kernel but cuDNN to have run and to agree with the dense path.
"""

import importlib.util
import json
import os

import jax.numpy as jnp
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gpu_check(name: str = "gpu_check"):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # ~11 s: seven attention kernels compiled forward and backward
def test_attention_check_runs_every_kernel_but_cudnn_on_cpu(capsys):
    _gpu_check().attention_kernels(True, 64)
    (line,) = capsys.readouterr().out.strip().splitlines()
    res = json.loads(line)
    assert res["check"] == "attention_kernels"
    kernels = {k: v for k, v in res.items() if isinstance(v, dict)}
    assert {"dense", "flash", "gathered_sparse", "grouped_sparse", "slots_sparse", "paged_sparse", "cudnn"} <= set(kernels)
    for name, r in kernels.items():
        if name == "cudnn":
            continue
        assert "error" not in r, (name, r)
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0
        if "rel_err_vs_dense" in r:
            assert r["rel_err_vs_dense"] < 1e-2, (name, r)  # bf16 against the dense path


@pytest.mark.slow  # ~30 s: three whole models compiled, one of them twice
def test_model_attention_check_runs_and_proves_the_fused_branch(capsys, monkeypatch):
    """The cudnn model check, on CPU through jax's XLA implementation of the same call (and the paged kernel
    interpreted): it runs, the cudnn model equals dense, the paged forward gather's, and a fallback that ran
    would show (the check poisons it)."""
    from m3jax.model import fused_attention
    gc = _gpu_check()
    gc.model_attention(True, 64)  # off a GPU: says why it is skipped
    assert "no GPU" in json.loads(capsys.readouterr().out)["skipped"]
    from m3jax.model import paged_sparse
    monkeypatch.setattr(fused_attention, "implementation", lambda backend=None: "xla")
    monkeypatch.setattr(paged_sparse, "interpret", lambda backend=None: True)
    gc.model_attention(True, 64)
    res = json.loads(capsys.readouterr().out)
    assert set(res) >= {"dense", "flash", "cudnn", "paged"} and all(res[k]["finite"] for k in ("dense", "flash", "cudnn"))
    assert res["cudnn"]["logits_rel_err"] < 1e-2
    assert res["paged"]["finite"] and res["paged"]["logits_mean_rel_err_vs_gather"] < 2e-2, res["paged"]  # bf16
    monkeypatch.setattr(fused_attention, "fused_form", lambda positions, key_valid: (jnp.asarray(False), None))
    gc.model_attention(True, 64, impls=("cudnn",), paged=False)  # every input on the (poisoned) fallback
    assert not json.loads(capsys.readouterr().out)["cudnn"]["finite"]


@pytest.mark.slow  # ~20 s: seven distinct trainer passes over 2,320 tokens
def test_vllm_checks_verdict_on_a_stand_in_engine(monkeypatch):
    """Check 8's parent side (the child needs CUDA): a stand-in child that answers with the trainer's own logprobs
    for A, then B, then A again passes, push included; one whose update left A's weights in place fails."""
    import subprocess

    import jax
    import numpy as np
    from flax import nnx

    gc = _gpu_check("gpu_check_vllm")
    # The check and the stand-in child ask for the same few passes (the same weights, built afresh in each call):
    # computed once each, keyed by the weights' contents, the two verdicts below cost one check's passes
    # (18 passes, ~50 s, without this).
    passes, compute = {}, gc.trainer_logprobs

    def trainer_logprobs(model, prompt, response, routes=None, with_routes=False):
        weights = tuple(float(jnp.sum(x)) for x in jax.tree.leaves(nnx.state(model)))
        key = (weights, model.cfg.index_topk_blocks, tuple(prompt), tuple(response),
               None if routes is None else np.asarray(routes).tobytes(), with_routes)
        if key not in passes:
            passes[key] = compute(model, prompt, response, routes=routes, with_routes=with_routes)
        return passes[key]

    monkeypatch.setattr(gc, "trainer_logprobs", trainer_logprobs)
    cfg, a = gc.m3_sparse_for_vllm()
    _, b = gc.m3_sparse_for_vllm(seed=1)
    stale = [False]

    def child(cmd, **kw):
        work = cmd[-1]
        with open(os.path.join(work, "request.json")) as f:
            req = json.load(f)
        assert sorted(os.listdir(work)) == ["ckpt", "ckpt_b", "request.json"]
        prompt, response = req["prompt"], list(range(3, 3 + req["max_new_tokens"]))
        lp_a = [float(x) for x in gc.trainer_logprobs(a, prompt, response)]
        lp_b = lp_a if stale[0] else [float(x) for x in gc.trainer_logprobs(b, prompt, response)]
        with open(os.path.join(work, "result.json"), "w") as f:
            json.dump(dict(response=response, generate=lp_a, score=lp_a, start_s=1.0, vllm="stand-in",
                           apply=["inplace", None], push=dict(mode=["inplace", None], apply_s=[0.1, 0.1], bytes=1,
                                                              score_b=lp_b, score_a_again=lp_a)), f)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(gc.subprocess, "run", child)
    monkeypatch.setattr(gc, "VLLM_RESPONSE", 16)  # a shorter response: two trainer passes less to wait for
    for is_stale in (False, True):
        stale[0] = is_stale
        res = gc.vllm_long_context()
        assert res["push"]["a_again_bitwise"] and res["push"]["a_to_b_trainer_mean_move"] > 0.1, res["push"]
        assert res["push"]["ok"] is (not is_stale) and res["ok"] is (not is_stale), res
        assert res["generate"]["max_abs_diff"] == 0.0


def test_moe_kernels_check_runs_every_kernel_on_cpu(capsys):
    """Check 5 at a small shape: ragged_dot, tiled, bucketed and pallas (interpreted here) run and agree; mosaic,
    which lowers only for a GPU, is said to be skipped."""
    _gpu_check().moe_kernels(True, 2, 4, 64)
    res = json.loads(capsys.readouterr().out)
    assert res["errors"] == {} and set(res["fwd_ms"]) == {"ragged_dot", "tiled", "tiled_512", "bucketed", "pallas"}
    assert list(res["skipped"]) == ["mosaic"]
    assert all(err < 2e-2 for err in res["value_rel_err"].values()), res  # bf16 against ragged_dot


def test_moe_kernel_timing_check_times_what_the_device_runs(capsys):
    """Check 5b at a small shape: the trainer's timing runs every kernel a CPU compiles and names the fastest."""
    _gpu_check().moe_kernel_timing(True, 4, 64)
    res = json.loads(capsys.readouterr().out)
    assert res["errors"] == {} and set(res["fwd_bwd_ms"]) == {"ragged_dot", "tiled", "bucketed"}
    assert res["choice"] == min(res["fwd_bwd_ms"], key=res["fwd_bwd_ms"].get) and res["work"]["rows"] == 256


@pytest.mark.slow  # ~12 s: every layer variant compiled forward and backward
def test_layer_costs_check_runs_every_variant_on_cpu(capsys):
    """Check 3b at a small shape: each layer kind builds, runs forward and backward, and gives finite states."""
    gc = _gpu_check()
    gc.layer_costs(True, 64, 4)
    res = json.loads(capsys.readouterr().out)
    names = [name for name, *_ in gc.LAYER_VARIANTS]
    assert [n for n in names if "error" in res[n]] == [], res
    assert all(res[n]["finite"] and res[n]["fwd_bwd_ms"] > 0 for n in names), res


def test_decode_layers_check_runs_both_stacks_on_cpu(capsys):
    """Check 13 at a small shape: the scanned and the unrolled decode step run on the same weights and agree."""
    _gpu_check().decode_layers(True, 4, 8, 2, 64)
    res = json.loads(capsys.readouterr().out)
    assert res["scanned"]["step_ms"] > 0 and res["unrolled"]["step_ms"] > 0, res
    assert res["logits_rel_diff"] < 1e-2, res  # bf16


def test_load_round_trip_check_reads_back_the_exported_weights(capsys):
    """Check 14 at a small shape: the exported model read back by from_pretrained gives the same logits."""
    _gpu_check().load_round_trip(True)
    res = json.loads(capsys.readouterr().out)
    assert res["logits_equal"] and res["bytes"] > 0 and res["seconds"] > 0, res


def test_moe_cost_check_runs_and_agrees(capsys):
    """Check 4 (its weights now jit arguments): grouped and every expert on every token agree."""
    _gpu_check().moe_cost(True, 4, 64)
    res = json.loads(capsys.readouterr().out)
    assert res["rel_err"] < 2e-2, res


def test_a_failing_check_is_reported_and_the_next_one_runs(capsys):
    gc = _gpu_check()

    def broken():
        raise RuntimeError("kernel refused")

    gc.guarded("broken", broken)
    gc.guarded("fine", lambda: {"check": "fine", "ok": True})
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines == [{"check": "broken", "error": "RuntimeError: kernel refused"}, {"check": "fine", "ok": True}]


def test_device_checksum_check_compares_and_catches_a_flip(monkeypatch):
    """Check 9 off a GPU says why; with a stand-in device (a copy on the CPU) it runs to its verdict."""
    import torch
    gc = _gpu_check("gpu_check_push")
    assert "no CUDA device" in gc.device_checksum(True)["skipped"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self: self.clone())
    res = gc.device_checksum(True)
    assert res["equal_to_cpu"] and res["flip_caught"] and res["spans"] == 4 and res["cuda_gb_s"] > 0


def test_weight_push_check_runs_both_stagings_bit_for_bit_on_host_buffers():
    """Check 10 off a GPU says why; on host buffers (the device options forced) both stagings arrive bit for bit,
    and a corrupted byte on the loopback wire would be refused (tests/test_weight_transfer_protocol.py)."""
    gc = _gpu_check("gpu_check_push")
    assert "no CUDA device" in gc.weight_push_device(True)["skipped"]
    res = gc.weight_push_device(True, device="cpu")
    for staging in ("device", "host"):
        row = res[staging]
        assert row["send_error"] is None and row["receive_error"] is None, row
        assert row["bit_for_bit"] and row["on"] == ["cpu"] and row["gb_s"] > 0, row


def test_host_reference_check_brings_the_tree_back_bit_for_bit():
    """Check 12 on the CPU: the tree is held in pinned host memory and comes back bit for bit, with its timings."""
    res = _gpu_check("gpu_check_reference").host_reference(True)
    assert "skipped" not in res and res["held_in"] == ["pinned_host"] and res["bit_for_bit"], res
    assert res["to_device_gb_s"] > 0 and res["to_host_s"] > 0 and "pinned_host" in res["memory_kinds"]


@pytest.mark.slow  # compiles two sharded train steps on 16 simulated devices in a child process
def test_mesh_compile_check_reads_both_layouts_on_16_simulated_devices():
    """Check 11 compiles the recipe's two weight layouts on 16 devices; on the CPU (--small) every figure comes
    back, and the collectives show the step copy's micro-batch loop gathering nothing over data."""
    res = _gpu_check("gpu_check_mesh").mesh_compile(True, timeout=600)
    assert "error" not in res, res
    for name in ("plain", "step copy"):
        row = res[name]
        assert "error" not in row, row
        assert row["xla_peak_gb"] > 0 and row["plan_gb"] > 0 and row["collectives_mb"], row
    over_data = {name: res[name]["collectives_mb"].get("all-gather over data in a loop", 0.0)
                 for name in ("plain", "step copy")}
    # the plain layout gathers weights over data in its loops; the copy only the embedding lookup's token rows
    assert over_data["step copy"] < 0.1 * over_data["plain"], over_data
