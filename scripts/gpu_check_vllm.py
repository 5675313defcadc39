"""Check 8 of scripts/gpu_check.py: the pool's GPU vLLM engine against the trainer over a long context (its
docstring says what and why), and the engine process it runs in (`python scripts/gpu_check_vllm.py DIR`, started
by the check: JAX in the parent holds most of the GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3jax import M3ForCausalLM

VLLM_PROMPT, VLLM_RESPONSE = 2304, 256  # > 2,048 tokens: 20 blocks of 128, of which the indexer keeps 4


def m3_sparse_for_vllm(seed: int = 0):
    """M3's layer pattern at tiny width, at the shapes vLLM's sparse kernels take (head_dim, index head_dim and
    block size 128); random norms and router bias (m3jax initialises them to 0) so every piece shows."""
    from m3jax.tiny import m3_config, m3_model
    cfg = m3_config(layers=4, vocab_size=2048, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=128, intermediate_size=128, dense_intermediate_size=512, num_local_experts=8,
                    index_n_heads=2, index_head_dim=128, index_block_size=128, index_topk_blocks=4,
                    max_position_embeddings=8192)
    model = m3_model(cfg, seed=seed)
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model)):
        v = np.asarray(var.get_value())
        if "norm" in path[-1] or path[-1] == "router_bias":
            v = (0.3 if "norm" in path[-1] else 0.1) * rng.standard_normal(v.shape)
        # bf16-representable weights: the engine serves bf16 (its indexer cache is bf16 at best), the
        # trainer's reference computes in fp32 on exactly those values.
        var.set_value(jnp.asarray(v, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))
    return cfg, model


@jax.jit
def _token_logprobs(model, seq, routes=None):
    from rl.generation.base import token_logprobs
    logits, own = model(seq, routes=routes, return_routes=True)
    return token_logprobs(logits[0, :-1], seq[0, 1:], 1.0), own


def trainer_logprobs(model, prompt, response, routes=None, with_routes=False):
    """The trainer's logprobs of `response` after `prompt`: one full forward, as GRPO computes them; with
    `routes` [tokens, n_moe_layers, k] the MoE layers replay them (grpo.routing_replay). with_routes: also
    the router's own top-k ids of every token, [tokens, n_moe_layers, k]."""
    seq = jnp.asarray([list(prompt) + list(response)], jnp.int32)
    if routes is not None:  # vLLM's cover every token but the last; the last is only a target
        routes = jnp.asarray(np.pad(routes, ((0, seq.shape[1] - len(routes)), (0, 0), (0, 0))))[None]
    lp, own = _token_logprobs(model, seq, routes)
    lp = np.asarray(lp)[len(prompt) - 1:]
    return (lp, np.asarray(own)[0]) if with_routes else lp


def vllm_long_context(timeout_s: int = 900) -> dict:
    """Check 8 (scripts/gpu_check.py's docstring): the result, with `ok`, or why it was skipped or failed."""
    import dataclasses
    import m3jax
    cfg, model = m3_sparse_for_vllm()
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(3, cfg.vocab_size, VLLM_PROMPT)]
    probe = [int(t) for t in rng.integers(3, cfg.vocab_size, VLLM_RESPONSE)]
    # CPU side: the same weights with every block selected (top-k = all 20 blocks = causal attention).
    every = M3ForCausalLM(dataclasses.replace(cfg, index_topk_blocks=(VLLM_PROMPT + VLLM_RESPONSE) // 128),
                          rngs=nnx.Rngs(0))
    nnx.update(every, nnx.state(model))
    t0 = time.perf_counter()
    sparse_lp = trainer_logprobs(model, prompt, probe)
    effect = np.abs(sparse_lp - trainer_logprobs(every, prompt, probe))
    base = dict(check="vllm_long_context", tokens=VLLM_PROMPT + VLLM_RESPONSE, block_size=128, topk_blocks=4,
                selection_effect={"max": float(effect.max()), "mean": float(effect.mean())},
                reference_finite=bool(np.isfinite(sparse_lp).all()), reference_s=time.perf_counter() - t0)
    _, other = m3_sparse_for_vllm(seed=1)  # the weights check 8 pushes into the running engine
    with tempfile.TemporaryDirectory() as work:
        m3jax.save_pretrained(model, os.path.join(work, "ckpt"), layout="released")
        m3jax.save_pretrained(other, os.path.join(work, "ckpt_b"), layout="released")
        with open(os.path.join(work, "request.json"), "w") as f:
            json.dump({"prompt": prompt, "max_new_tokens": VLLM_RESPONSE}, f)
        env = dict(os.environ, JAX_PLATFORMS="cpu")  # the child never computes with JAX
        try:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), work], env=env,
                                  capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return dict(base, error=f"the vLLM child ran past {timeout_s} s")
        try:
            with open(os.path.join(work, "result.json")) as f:
                got = json.load(f)
        except FileNotFoundError:
            return dict(base, error=f"vLLM child exited {proc.returncode} without a result: "
                                   f"{proc.stderr.strip()[-1500:]}")
    if "skipped" in got or "error" in got:
        return dict(base, **got)
    response = got["response"]
    want = trainer_logprobs(model, prompt, response)
    effect = float(np.abs(want - trainer_logprobs(every, prompt, response)).mean())
    out = dict(base, vllm=got["vllm"], response_tokens=len(response), engine_start_s=got["start_s"],
               selection_effect_on_response=effect, weight_apply=got.get("apply"))
    for path in ("generate", "score"):  # decode-path top-k, prefill-path top-k
        d = np.abs(np.asarray(got[path], np.float64) - want)
        out[path] = {"max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()),
                     "p99_abs_diff": float(np.quantile(d, 0.99)), "finite": bool(np.isfinite(d).all())}
    if "routes" in got:  # issue 14 item 1 on the GPU engine: vLLM's routes vs the trainer's, and replayed
        from rl.grpo.mismatch import route_mismatch_frac
        vllm_routes = np.asarray(got["routes"], np.int16)
        _, own = trainer_logprobs(model, prompt, response, with_routes=True)
        n = len(vllm_routes)
        mask = np.ones((1, n), np.int32)
        replayed = trainer_logprobs(model, prompt, response, routes=vllm_routes)
        gen = np.asarray(got["generate"], np.float64)
        out["routes"] = {
            "tokens": n, "shape": list(vllm_routes.shape),
            "route_mismatch_frac": float(route_mismatch_frac(own[None, :n], vllm_routes[None], mask)),
            # the generator's logprobs against the trainer's, without and with its routes replayed
            "gen_mean_abs_diff": float(np.abs(gen - want).mean()),
            "gen_mean_abs_diff_replayed": float(np.abs(gen - replayed).mean())}
    # bf16 serving against an fp32 reference cannot match to 1e-4; what must hold is that the engine sits
    # nearer the trainer than another block choice would move it (a wrong or non-causal block, a NaN fail).
    out["ok"] = all(out[p]["finite"] and out[p]["mean_abs_diff"] < 0.5 * effect for p in ("generate", "score"))
    if "push" in got:
        push = got["push"]
        if "error" not in push:
            want_b = trainer_logprobs(other, prompt, response)
            d = np.abs(np.asarray(push["score_b"], np.float64) - want_b)
            moved = float(np.abs(want_b - want).mean())  # how far B's logprobs sit from A's: a stale apply's error
            push = {"apply_s": push["apply_s"], "bytes": push["bytes"], "mode": push["mode"],
                    "b_vs_trainer_mean_abs_diff": float(d.mean()),
                    "b_vs_trainer_max_abs_diff": float(d.max()), "a_to_b_trainer_mean_move": moved,
                    "a_again_bitwise": push["score_a_again"] == got["score"]}
            push["ok"] = bool(np.isfinite(d).all() and d.mean() < 0.5 * moved and push["a_again_bitwise"])
            out["ok"] = out["ok"] and push["ok"]
        out["push"] = push
    return out


def push_round_trip(eng, prompt, response, ckpt_a: str, ckpt_b: str) -> dict:
    """Write the checkpoint at ckpt_b into the running engine, score `response`, write ckpt_a back, score again:
    the engine's weight update path (in place or reload_weights, as `eng.apply_mode` says) on this platform."""
    from safetensors.numpy import load_file

    def tensors(path):
        return [item for f in sorted(os.listdir(path)) if f.endswith(".safetensors")
                for item in load_file(os.path.join(path, f)).items()]

    out = {"mode": [eng.apply_mode, eng.apply_fallback], "apply_s": []}
    for key, path in (("score_b", ckpt_b), ("score_a_again", ckpt_a)):
        named = tensors(path)
        out["bytes"] = sum(a.nbytes for _, a in named)
        t = time.perf_counter()
        eng.load_weights(named)
        out["apply_s"].append(time.perf_counter() - t)
        out[key] = [float(x) for x in eng.score([prompt], [response])[0]]
    return out


def vllm_child(work: str):
    """In a fresh process: serve the checkpoint with the pool's engine on CUDA, greedy-generate, score."""
    def done(**kw):
        with open(os.path.join(work, "result.json"), "w") as f:
            json.dump(kw, f)
    try:
        import vllm
        from vllm.platforms import current_platform
    except Exception as e:  # noqa: BLE001 (any import failure means: no engine to check)
        return done(skipped=f"vllm is not importable: {type(e).__name__}: {e}")
    if not current_platform.is_cuda():
        return done(skipped=f"no CUDA device: vLLM {vllm.__version__} runs on platform "
                            f"{type(current_platform).__name__} (vLLM's sparse M3 layers are CUDA/ROCm only)")
    from rl.generation.base import SamplingParams
    from rl.generation.vllm_engine import VLLMEngine
    with open(os.path.join(work, "request.json")) as f:
        req = json.load(f)
    try:
        # JAX in the parent keeps most of the GPU; this tiny model needs a sliver.
        eng = VLLMEngine(os.path.join(work, "ckpt"), dtype="bfloat16", max_model_len=4096, gpu_memory_utilization=0.1,
                         return_routes=True)
        (ids, lps, _, routes), = eng.generate([req["prompt"]], SamplingParams(max_new_tokens=req["max_new_tokens"],
                                                                              temperature=0.0), seeds=[0])
        scored = eng.score([req["prompt"]], [ids])[0]
        # apply: whether this engine writes a weight update in place on CUDA, and if not why (which MoE kernel
        # class vLLM picked: rl.generation.inplace._PLAIN_MOE_EXPERTS lists the ones cleared)
        result = dict(response=ids, generate=lps, score=[float(x) for x in scored], start_s=eng.start_seconds,
                      vllm=vllm.__version__, routes=routes.tolist(), apply=[eng.apply_mode, eng.apply_fallback])
        try:  # after the logprobs: a failing update must not lose them
            result["push"] = push_round_trip(eng, req["prompt"], ids, os.path.join(work, "ckpt"),
                                             os.path.join(work, "ckpt_b"))
        except Exception as e:  # noqa: BLE001 (reported as the push's result)
            result["push"] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
        done(**result)
        eng.shutdown()
    except Exception as e:  # noqa: BLE001 (reported as the check's result)
        done(error=f"{type(e).__name__}: {str(e)[:1500]}")


if __name__ == "__main__":
    vllm_child(sys.argv[1])
