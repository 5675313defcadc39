"""The kernel-level checks of scripts/gpu_check.py (3b, 4, 5, 6, 7) and the helpers every check shares: each a
function that prints one JSON line (see gpu_check.py's docstring for what each measures and why)."""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from m3jax import M3Config, M3ForCausalLM
from m3jax.model.mlp import swiglu_oai
from m3jax.model.moe import grouped_experts, route
from sharding.expert import local_experts
from sharding.grouped_matmul import DEFAULT_TILE
from sharding.layout import on_gpu


def emit(**kw):
    print(json.dumps(kw), flush=True)


def timed(fn, *args, iters=5):
    out = fn(*args)
    jax.block_until_ready(out)
    t = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        t.append(time.perf_counter() - t0)
    return float(np.median(t)), out


def m3_shaped(small: bool, layers: int, experts: int) -> M3Config:
    if small:
        d, h, kv, hd, i, di, v = 128, 4, 2, 32, 64, 256, 512
    else:
        d, h, kv, hd, i, di, v = 6144, 64, 4, 128, 3072, 12288, 200064
    return M3Config(vocab_size=v, hidden_size=d, num_hidden_layers=layers, num_attention_heads=h,
                    num_key_value_heads=kv, head_dim=hd, intermediate_size=i, dense_intermediate_size=di,
                    shared_intermediate_size=i, num_local_experts=experts, num_experts_per_tok=4,
                    partial_rotary_factor=0.5, layer_types=("full_attention",) + ("minimax_m3_sparse",) * (layers - 1),
                    mlp_layer_types=("dense",) + ("sparse",) * (layers - 1), index_n_heads=kv,
                    index_head_dim=hd, index_block_size=128 if not small else 16, index_topk_blocks=16 if not small else 2)


LAYER_VARIANTS = (  # (name, attention kind, MLP kind, model options): one layer each, to split the step's time
    ("full+dense", "full_attention", "dense", {}),
    ("full_flash+dense", "full_attention", "dense", {"attention_impl": "flash"}),
    ("sparse+dense", "minimax_m3_sparse", "dense", {}),
    ("full+moe_ragged_dot", "full_attention", "sparse", {"moe_kernel": "ragged_dot"}),
    ("full+moe_tiled", "full_attention", "sparse", {"moe_kernel": "tiled"}),
)


def layer_costs(small: bool, seq: int, experts: int, variants=LAYER_VARIANTS):
    """Check 3b: one decoder layer of each kind at the MFU check's widths, forward and forward+backward of its
    hidden states (no LM head; bf16, no remat), so the train step's time can be split by layer kind: subtract
    full+dense from a variant for the cost of its sparse attention (indexer included) or its MoE (router, dispatch
    and the expert kernel named)."""
    import dataclasses
    res = {}
    for name, attn, mlp, options in variants:
        cfg = dataclasses.replace(m3_shaped(small, 1, experts), vocab_size=1024, layer_types=(attn,),
                                  mlp_layer_types=(mlp,))
        try:
            model = M3ForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), remat=False, **options)
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)
            ids = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (1, seq)), jnp.int32)
            cot = jax.random.normal(jax.random.key(5), (1, seq, cfg.hidden_size), jnp.bfloat16)

            def hidden(params, graphdef=graphdef, rest=rest):
                return nnx.merge(graphdef, params, rest)(ids, hidden=True)

            tf, h = timed(jax.jit(hidden), params)
            tb, _ = timed(jax.jit(jax.grad(lambda p: jnp.sum((hidden(p) * cot).astype(jnp.float32)))), params)
            res[name] = {"fwd_ms": tf * 1e3, "fwd_bwd_ms": tb * 1e3, "finite": bool(jnp.isfinite(h).all())}
        except Exception as e:  # noqa: BLE001 - one variant's failure must not hide the others' figures
            res[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    emit(check="layer_costs", seq=seq, experts=experts, **res)


def moe_cost(small: bool, experts: int, tokens: int):
    d, i = (128, 64) if small else (6144, 3072)
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (tokens, d), jnp.bfloat16)
    router = jax.random.normal(k[1], (experts, d), jnp.float32) / d ** 0.5
    gate_up = (jax.random.normal(k[2], (experts, 2, i, d), jnp.bfloat16) / d ** 0.5)
    down = (jax.random.normal(k[3], (experts, d, i), jnp.bfloat16) / i ** 0.5)
    w, idx = route(x, router, jnp.zeros(experts), top_k=4)
    # the weights are arguments: closed over, XLA would fold them into the program as constants (7.25 GB at 64
    # experts: minutes of compiling)
    grouped = jax.jit(lambda x, w, idx, gate_up, down: local_experts(
        x, w, idx, lambda rows, sizes: grouped_experts(rows, sizes, gate_up, down, alpha=1.702, limit=7.0), experts))

    @jax.jit
    def dense(x, w, idx, gate_up, down):
        gu = jnp.einsum("td,ecid->teci", x, gate_up)
        act = swiglu_oai(gu[:, :, 0], gu[:, :, 1], 1.702, 7.0)
        out = jnp.einsum("tei,edi->ted", act, down)
        weight = jnp.zeros((x.shape[0], experts), jnp.float32).at[jnp.arange(x.shape[0])[:, None], idx].set(w)
        return jnp.einsum("ted,te->td", out.astype(jnp.float32), weight).astype(x.dtype)

    tg, a = timed(grouped, x, w, idx, gate_up, down)
    td, b = timed(dense, x, w, idx, gate_up, down)
    err = float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max() / jnp.abs(b.astype(jnp.float32)).max())
    emit(check="moe_grouped_vs_dense", experts=experts, tokens=tokens, grouped_ms=tg * 1e3, dense_ms=td * 1e3,
         dense_over_grouped=td / tg, rel_err=err)


def moe_kernels(small: bool, experts: int, pool: int, real_rows: int):
    d, i = (128, 64) if small else (6144, 3072)
    k = jax.random.split(jax.random.key(1), 4)
    n = pool * real_rows
    rows = jnp.zeros((n, d), jnp.bfloat16).at[:real_rows].set(jax.random.normal(k[0], (real_rows, d), jnp.bfloat16))
    # a multinomial load around the balanced one (an even split would fill every tile and bucket exactly,
    # hiding the partial tiles and overflow a real router's load brings)
    sizes = jnp.asarray(np.random.default_rng(0).multinomial(real_rows, np.full(experts, 1 / experts)), jnp.int32)
    gate_up = jax.random.normal(k[1], (experts, 2, i, d), jnp.bfloat16) / d ** 0.5
    down = jax.random.normal(k[2], (experts, d, i), jnp.bfloat16) / i ** 0.5
    cot = jax.random.normal(k[3], (n, d), jnp.bfloat16)
    out, errors = {}, {}
    # tiled at its default tile (128 rows, chosen on CPU) and at 512: on a GPU its walk's steps are launches, and
    # a 4x larger tile takes 4x fewer of them for at most E x 384 more padding rows. bucketed: the balanced load
    # fills its buckets exactly (one batched matmul, an empty overflow walk), told it as routed_experts tells it.
    variants = {"ragged_dot": ("ragged_dot", DEFAULT_TILE), "tiled": ("tiled", DEFAULT_TILE), "tiled_512": ("tiled", 512),
                "bucketed": ("bucketed", DEFAULT_TILE), "pallas": ("pallas", DEFAULT_TILE)}
    skipped = {}
    if on_gpu():  # jax's Mosaic GPU kernels (Hopper): lowered nowhere else, refused by name off a GPU
        variants["mosaic"] = ("mosaic", DEFAULT_TILE)
    else:
        skipped["mosaic"] = "Mosaic GPU kernels lower only for a GPU (Hopper)"
    for name, (kernel, tile) in variants.items():
        f = lambda r, gu, dn, kernel=kernel, tile=tile: grouped_experts(  # noqa: E731
            r, sizes, gu, dn, alpha=1.702, limit=7.0, kernel=kernel, tile=tile, expected_rows=real_rows / experts)
        fwd = jax.jit(f)
        bwd = jax.jit(jax.grad(lambda r, gu, dn: jnp.sum((f(r, gu, dn) * cot).astype(jnp.float32)), argnums=(0, 1, 2)))
        try:  # pallas, mosaic: their first runs on a GPU; a failure must not lose the other kernels' figures
            out[name] = (*timed(fwd, rows, gate_up, down), *timed(bwd, rows, gate_up, down))
        except Exception as e:  # noqa: BLE001
            errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
    rel = lambda a, b: float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max()  # noqa: E731
                             / jnp.abs(b.astype(jnp.float32)).max())
    _, y_r, _, g_r = out["ragged_dot"]
    emit(check="moe_kernels", experts=experts, pool_x=pool, real_rows=real_rows, rows=n,
         rows_per_expert=[int(x) for x in sizes],
         fwd_ms={k: v[0] * 1e3 for k, v in out.items()}, fwd_bwd_ms={k: v[2] * 1e3 for k, v in out.items()},
         value_rel_err={k: rel(v[1], y_r) for k, v in out.items() if k != "ragged_dot"},
         grad_rel_err={k: [rel(a, b) for a, b in zip(v[3], g_r)] for k, v in out.items() if k != "ragged_dot"},
         errors=errors, skipped=skipped)


def moe_kernel_timing(small: bool, experts: int, tokens: int):
    """Check 5b: the trainer's timing of the expert kernels (`m3jax.model.expert_tuning`, what `moe_kernel: auto` runs
    off a CPU) on one device's expert MLP of the MFU slice (`experts` experts, `tokens` tokens x top-4, bf16,
    forward and backward): each kernel's median, the one it picks, and the seconds it took, compiles included."""
    import dataclasses

    from m3jax.model.expert_tuning import ExpertWork, time_expert_kernels
    from sharding.kernel_tuning import fastest
    cfg = m3_shaped(small, 2, experts)
    rows = tokens * cfg.num_experts_per_tok
    work = ExpertWork(rows, rows, experts, cfg.hidden_size, cfg.intermediate_size, "bfloat16")
    t0 = time.perf_counter()
    ms, errors, temps = time_expert_kernels(cfg, work)
    emit(check="moe_kernel_timing", work=dataclasses.asdict(work), fwd_bwd_ms=ms, errors=errors, temp_bytes=temps,
         choice=fastest(ms) if ms else None, seconds=time.perf_counter() - t0)


def attention_kernels(small: bool, seq: int, skip: tuple = ()):
    from types import SimpleNamespace

    from m3jax.model.attention import _from_chunks, _to_chunks, causal_keep, gqa_attention
    from m3jax.model.flash import flash_attention
    from m3jax.model.indexer import block_ids_to_mask, block_mask_to_tokens
    from m3jax.model.paged_sparse import paged_sparse_attention
    from m3jax.model.sparse import head_units, sparse_layer_attention
    b, h, kv, hd, bs, topk = (1, 4, 2, 32, 16, 2) if small else (1, 64, 4, 128, 128, 16)
    k = jax.random.split(jax.random.key(2), 4)
    q, kk, v = (jax.random.normal(k[i], (b, seq, n, hd), jnp.bfloat16) for i, n in ((0, h), (1, kv), (2, kv)))
    do = jax.random.normal(k[3], (b, seq, h, hd), jnp.bfloat16)
    scale = hd ** -0.5
    pos = jnp.broadcast_to(jnp.arange(seq), (b, seq))
    nb = seq // bs  # the indexer's selection shape: each query block's own block + topk - 1 random earlier ones
    qb = jnp.arange(nb)
    noise = jax.random.uniform(jax.random.key(3), (b, kv, nb, nb))
    noise = jnp.where(qb[None, None, None, :] > qb[:, None], -jnp.inf, noise)
    noise = jnp.where(qb[None, None, None, :] == qb[:, None], jnp.inf, noise)
    top, ids = jax.lax.top_k(noise, topk)
    ids = jnp.repeat(jnp.where(top > -jnp.inf, ids, -1), bs, axis=2)  # [B, KV, S, topk], a row per query
    block_mask = block_ids_to_mask(ids, nb)  # [B, KV, S, nb]
    sparse_cfg = SimpleNamespace(index_block_size=bs, index_topk_blocks=topk, index_local_blocks=1, head_dim=hd)

    def sparse(path):
        return lambda q, k, v: sparse_layer_attention(
            q, k, v, pos, None, None, None, sparse_cfg, to_chunks=_to_chunks, from_chunks=_from_chunks,
            block_ids=jnp.moveaxis(ids, 1, 2), path=path)

    kernels = {
        "dense": lambda q, k, v: gqa_attention(q, k, v, causal_keep(pos, None, seq), scale),
        "flash": lambda q, k, v: flash_attention(q, k, v, scale=scale, positions=pos),
        "dense_sparse": lambda q, k, v: gqa_attention(
            q, k, v, causal_keep(pos, None, seq) & block_mask_to_tokens(block_mask, bs, seq, h), scale),
        "flash_sparse": lambda q, k, v: flash_attention(q, k, v, scale=scale, positions=pos, block_mask=block_mask,
                                                        block_size=bs, k_tile=bs),
        "gathered_sparse": sparse("tiles"),
        "grouped_sparse": sparse("grouped"),
        "slots_sparse": sparse("slots"),
        # the paged kernel's forward (`sparse_attention: paged`); its gradient is gather's by construction
        "paged_sparse": lambda q, k, v: paged_sparse_attention(
            q, k, v, pos, None, jnp.moveaxis(ids, 1, 2), sparse_cfg, *head_units(h, kv, kv),
            gather=lambda q, k, v, block_ids, positions, key_valid: sparse_layer_attention(
                q, k, v, positions, key_valid, None, None, sparse_cfg, to_chunks=_to_chunks, from_chunks=_from_chunks,
                block_ids=block_ids, path="tiles")),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                              implementation="cudnn"),
    }
    res, ref, ref_sparse = {}, None, None
    for name, f in kernels.items():
        if name in skip:
            res[name] = {"skipped": "left out at this length"}
            continue
        try:
            fwd = jax.jit(f)
            bwd = jax.jit(jax.grad(lambda q, k, v, f=f: jnp.sum((f(q, k, v) * do).astype(jnp.float32)), argnums=(0, 1, 2)))
            tf, out = timed(fwd, q, kk, v)
            tb, _ = timed(bwd, q, kk, v)
        except Exception as e:  # cuDNN off a GPU, or a shape its constraints refuse: say so, keep going
            res[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            continue
        out = out.astype(jnp.float32)
        ref = out if name == "dense" else ref
        ref_sparse = out if name == "dense_sparse" else ref_sparse
        res[name] = {"fwd_ms": tf * 1e3, "fwd_bwd_ms": tb * 1e3}
        against = ref_sparse if "sparse" in name else ref
        if name not in ("dense", "dense_sparse") and against is not None:
            res[name]["rel_err_vs_dense"] = float(jnp.abs(out - against).max() / jnp.abs(against).max())
    emit(check="attention_kernels", seq=seq, heads=h, kv_heads=kv, head_dim=hd, block_size=bs, **res)


def logprob_head(small: bool, tokens: int, chunk: int):
    from rl.generation.base import token_logprobs
    from rl.logprobs import chunked_token_logprobs
    from m3jax.model.decoder import lm_head_logits
    d, vocab = (64, 4096) if small else (6144, 200064)
    k = jax.random.split(jax.random.key(4), 3)
    hidden = jax.random.normal(k[0], (1, tokens, d), jnp.bfloat16)
    head = (jax.random.normal(k[1], (vocab, d), jnp.float32) / d ** 0.5).astype(jnp.bfloat16)
    targets = jax.random.randint(k[2], (1, tokens), 0, vocab)
    full = lambda h, w: token_logprobs(lm_head_logits(h, w), targets, 1.0)  # noqa: E731
    chunked = lambda h, w: chunked_token_logprobs(h, w, targets, 1.0, chunk_tokens=chunk)  # noqa: E731
    out = {}
    for name, f in (("full", full), ("chunked", chunked)):
        tf, lp = timed(jax.jit(f), hidden, head)
        tb, _ = timed(jax.jit(jax.grad(lambda h, w, f=f: jnp.sum(f(h, w)), argnums=(0, 1))), hidden, head)
        out[name] = (tf, tb, lp)
    emit(check="logprob_head", tokens=tokens, vocab=vocab, chunk_tokens=chunk,
         fwd_ms={n: v[0] * 1e3 for n, v in out.items()}, fwd_bwd_ms={n: v[1] * 1e3 for n, v in out.items()},
         max_abs_diff=float(jnp.abs(out["full"][2] - out["chunked"][2]).max()))
