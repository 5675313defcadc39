"""Each vLLM CPU patch against the m3jax model's own functions on random tensors, plus the registry's
guards (idempotent, refuses another vLLM version or a changed signature, per platform and release: CPU
patches are never selected on CUDA, an unlisted or refused release stops). No engine is started."""

import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from m3jax.model.mlp import dense_mlp
from m3jax.model.moe import route
from m3jax.model.norms import rms_norm
from m3jax.model.rope import apply_rope, rope_cos_sin
from rl.generation import vllm_patch_registry, vllm_patches
from rl.generation.vllm_patches import PATCH_SETS, PATCHES, Patch, PatchError, Refused, apply_patches, selected_patches

pytest.importorskip("vllm")


@pytest.fixture(scope="module", autouse=True)
def patched():
    apply_patches()


def rand(*shape, seed=0, scale=1.0):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale)


def jx(t):
    return jnp.asarray(t.numpy())


def test_registry_is_idempotent_and_marks_every_patch():
    assert apply_patches() == []  # the fixture applied everything already
    for p in PATCHES:
        assert getattr(vllm_patches._resolve(p)[2], vllm_patches._MARK) == p.name
        assert p.reason and p.name and p.targets == "0.32.0"
    assert vllm_patches.WorkerExtension().m3jax_patches() == [p.name for p in PATCHES]


def test_refuses_other_vllm_version(monkeypatch):
    import vllm
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    for p in PATCHES:  # already applied or not: a new vLLM is refused before anything else
        with pytest.raises(PatchError, match=f"{p.name!r} was written for vllm 0.32.0, vllm 0.33.0"):
            p.apply()


def test_refuses_changed_or_missing_symbol():
    changed = Patch("demo", "r", "json", "dumps", ("obj",), lambda f: f, "0.32.0")
    with pytest.raises(PatchError, match="'demo'.*json.dumps now takes"):
        changed.apply()
    missing = Patch("demo2", "r", "json", "no_such_function", (), lambda f: f, "0.32.0")
    with pytest.raises(PatchError, match="json.no_such_function does not exist"):
        missing.apply()


def test_patch_sets_per_platform_and_release():
    assert selected_patches("cpu", "0.32.0") == (vllm_patches._TORCHVISION, *PATCHES, *vllm_patches.RAY_CPU_PATCHES)
    assert selected_patches("cuda", "0.32.0") == ()
    cpu = {p.name for entry in PATCH_SETS["cpu"].values() for p in entry}
    for platform, releases in PATCH_SETS.items():
        for version, entry in releases.items():
            if isinstance(entry, Refused):
                continue
            assert all(p.targets == version for p in entry), (platform, version)
            if platform != "cpu":
                assert not cpu & {p.name for p in entry}, f"a CPU patch is listed for {platform} {version}"
    # the running platform here is the CPU one; asking for CUDA applies nothing and checks the release
    assert vllm_patch_registry.platform_name() == "cpu"
    assert apply_patches(platform="cuda") == []


@pytest.fixture()
def toy():
    """A module with one function, patched through a private table (not vLLM's symbols)."""
    import vllm
    mod = types.ModuleType("m3jax_toy_target")
    mod.f = lambda x: x
    sys.modules[mod.__name__] = mod
    patch = Patch("toy_double", "demo", mod.__name__, "f", ("x",), lambda f: (lambda x: 2 * f(x)),
                  targets=vllm.__version__)
    yield mod, patch, vllm.__version__
    del sys.modules[mod.__name__]


def test_cuda_never_loads_cpu_patches(toy):
    mod, patch, v = toy
    sets = {"cpu": {v: (patch,)}, "cuda": {v: ()}}
    assert vllm_patch_registry.apply(sets, "cuda", v) == [] and mod.f(3) == 3
    assert vllm_patch_registry.apply(sets, "cpu", v) == ["toy_double"] and mod.f(3) == 6
    assert vllm_patch_registry.apply(sets, "cpu", v) == [] and mod.f(3) == 6  # idempotent
    skipped = Patch("toy_unneeded", "demo", mod.__name__, "f", ("x",), lambda f: f, targets=v, needed=lambda: False)
    assert vllm_patch_registry.apply({"cpu": {v: (skipped,)}}, "cpu", v) == []


def test_unlisted_or_refused_release_is_refused(toy):
    mod, patch, v = toy
    for platform in ("cpu", "cuda"):
        with pytest.raises(PatchError, match=f"vllm 0.33.0 on {platform}: no patch set was reviewed for this "
                                             "release \\(reviewed: 0.32.0\\)"):
            apply_patches(platform=platform, version="0.33.0")
    for version in ("0.25.1", "0.26.0"):  # read and refused: the top-k buffer layout bug (vLLM PR 49149)
        with pytest.raises(PatchError, match=f"vllm {version} on cuda is refused: lacks vLLM PR 49149"):
            apply_patches(platform="cuda", version=version)
    with pytest.raises(PatchError, match="no vLLM patch set for platform 'rocm'"):
        apply_patches(platform="rocm")
    with pytest.raises(PatchError, match="patches \\['toy_double'\\] were written for another release"):
        vllm_patch_registry.apply({"cpu": {"0.1.0": (patch,)}}, "cpu", "0.1.0")
    assert mod.f(3) == 3  # nothing was applied on the way


def test_gemma_norm_with_and_without_residual():
    from vllm.models.minimax_m3.nvidia.model import MiniMAXGemmaRMSNorm
    norm = MiniMAXGemmaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(rand(64, seed=1, scale=0.3))
    x, res = rand(7, 64, seed=2), rand(7, 64, seed=3)
    want = np.asarray(rms_norm(jx(x), jx(norm.weight.detach()), 1e-6))
    np.testing.assert_allclose(norm(x).detach().numpy(), want, atol=1e-5)
    y, new_res = norm(x, res)
    np.testing.assert_allclose(new_res.detach().numpy(), (x + res).numpy(), atol=0)
    want = np.asarray(rms_norm(jx(x + res), jx(norm.weight.detach()), 1e-6))
    np.testing.assert_allclose(y.detach().numpy(), want, atol=1e-5)


@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_qknorm_rope_matches_model(factor):
    from vllm import _custom_ops as ops
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    h, kv, hd, t = 4, 2, 64, 9
    with set_current_vllm_config(VllmConfig()):  # vLLM's own cache: [cos | sin] rows by position
        rope = get_rope(hd, max_position=128, rope_parameters={"rope_theta": 5e6, "partial_rotary_factor": factor})
    qkv = rand(t, (h + 2 * kv) * hd, seed=4)
    qn, kn = rand(hd, seed=5, scale=0.3), rand(hd, seed=6, scale=0.3)
    pos = torch.tensor([0, 1, 2, 5, 9, 17, 33, 64, 100])
    out = qkv.clone()
    ops.fused_minimax_m3_qknorm_rope_kv_insert(out, qn, kn, rope.cos_sin_cache, pos, h, kv, rope.rotary_dim, 1e-6)

    cos, sin = rope_cos_sin(jnp.asarray(pos.numpy())[None], int(hd * factor), 5e6, jnp.float32)
    heads = qkv.view(t, h + 2 * kv, hd)

    def ref(part, w):
        return np.asarray(apply_rope(rms_norm(jx(part)[None], jx(w), 1e-6), cos, sin))[0]
    got = out.view(t, h + 2 * kv, hd).numpy()
    np.testing.assert_allclose(got[:, :h], ref(heads[:, :h], qn), atol=2e-5)
    np.testing.assert_allclose(got[:, h:h + kv], ref(heads[:, h:h + kv], kn), atol=2e-5)
    np.testing.assert_array_equal(got[:, h + kv:], heads[:, h + kv:].numpy())  # v untouched


def test_qknorm_rope_refuses_sparse_layers():
    from vllm import _custom_ops as ops
    qkv = rand(2, 4 * 64)
    with pytest.raises(NotImplementedError, match="sparse"):
        ops.fused_minimax_m3_qknorm_rope_kv_insert(qkv, rand(64), rand(64), rand(16, 64), torch.tensor([0, 1]),
                                                   2, 1, 64, 1e-6, num_index_heads=1)


def test_router_sigmoid_bias_matches_model_route():
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter
    x, gate, bias = rand(11, 32, seed=7), rand(8, 32, seed=8, scale=0.2), rand(8, seed=9, scale=0.1)
    router = CPURouter(top_k=3, global_num_experts=8, renormalize=True, scoring_func="sigmoid",
                       routed_scaling_factor=2.0, e_score_correction_bias=bias)
    w, ids = router._compute_routing(x, x @ gate.T, None)
    want_w, want_ids = route(jx(x), jx(gate), jx(bias), top_k=3)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    np.testing.assert_array_equal(ids.numpy(), np.asarray(want_ids))
    np.testing.assert_allclose(w.numpy(), 2.0 * np.asarray(want_w), atol=1e-6)


def test_router_softmax_path_unchanged():
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter
    router = CPURouter(top_k=2, global_num_experts=8, renormalize=True, scoring_func="softmax")
    logits = rand(5, 8, seed=10)
    w, ids = router._compute_routing(None, logits, None)
    top = torch.topk(logits, 2)
    np.testing.assert_allclose(w.numpy(), torch.softmax(top.values, -1).numpy(), atol=1e-6)
    assert set(map(tuple, ids.sort(-1).values.tolist())) == set(map(tuple, top.indices.sort(-1).values.tolist()))


def torch_experts():
    from vllm.model_executor.layers.fused_moe.activation import ApplyMoEActivationConfig
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend, backend_to_kernel_cls
    candidates = backend_to_kernel_cls(UnquantizedMoeBackend.CPU)
    cls = candidates[-1]
    assert cls.__name__ == "M3TorchExperts" and len(candidates) == 5  # appended after the 4 native kernels
    experts = cls.__new__(cls)  # apply() reads only the activation config
    experts.activation_config = ApplyMoEActivationConfig(clamp_limit=7.0, alpha=1.702, beta=1.0)
    return experts


@pytest.mark.parametrize("local", [False, True])
def test_torch_experts_match_model_mlp(local):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    e, i, d, t, k = 6, 16, 32, 10, 2
    x, w13, w2 = rand(t, d, seed=11), rand(e, 2 * i, d, seed=12, scale=1.5), rand(e, d, i, seed=13, scale=0.3)
    ids = torch.from_numpy(np.stack([np.random.default_rng(14 + n).choice(e, k, replace=False)
                                     for n in range(t)])).int()
    weights = torch.rand(t, k, generator=torch.Generator().manual_seed(15)) * 2
    owned = np.arange(e) if not local else np.array([1, 3, 4])  # this rank's experts (expert parallel)
    expert_map = None
    if local:
        expert_map = torch.full((e,), -1, dtype=torch.int32)
        expert_map[torch.from_numpy(owned)] = torch.arange(len(owned), dtype=torch.int32)
        w13, w2 = w13[owned], w2[owned]
    out = torch.empty(t, d)
    torch_experts().apply(out, x, w13, w2, weights, ids, MoEActivation.SWIGLUOAI_UNINTERLEAVE, e, expert_map,
                          None, None, None, None, None, False)

    want = np.zeros((t, d), np.float32)
    for n in range(t):
        for j in range(k):
            g = int(ids[n, j])
            if g not in owned:
                continue
            slot = int(np.where(owned == g)[0][0])
            gate_up = jx(w13[slot]).reshape(2, i, d)
            y = dense_mlp(jx(x[n]), gate_up, jx(w2[slot]), 1.702, 7.0)
            want[n] += float(weights[n, j]) * np.asarray(y)
    np.testing.assert_allclose(out.numpy(), want, atol=1e-4, rtol=1e-5)


def test_ray_cpu_patches_only_with_the_ray_executor(monkeypatch):
    """The two Ray-executor patches (issue 12 item 1) load only in a process EXECUTOR_ENV marks as a Ray
    engine (engine actor or RayWorkerProc); the in-process and multiprocess engines never see them."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.executor import ray_executor_v2

    from rl.generation import vllm_ray
    key, ids = CpuPlatform.ray_device_key, ray_executor_v2.RayWorkerProc.get_node_and_physical_gpu_ids
    mod, fn = vllm_ray.SETUP_HOOK.rsplit(".", 1)  # the hook the engine actor hands to vLLM's Ray workers
    assert mod == vllm_patches.__name__ and getattr(vllm_patches, fn) is vllm_patches.worker_setup
    monkeypatch.delenv(vllm_ray.EXECUTOR_ENV, raising=False)
    assert apply_patches() == [] and CpuPlatform.ray_device_key == ""
    assert not any(p.installed() for p in vllm_patches.RAY_CPU_PATCHES)
    try:
        monkeypatch.setenv(vllm_ray.EXECUTOR_ENV, "ray")
        assert apply_patches() == ["ray_cpu_device_key", "ray_worker_cpu_node_ids"]
        assert CpuPlatform.ray_device_key == vllm_ray.CPU_SLOT
        assert all(p.installed() for p in vllm_patches.RAY_CPU_PATCHES) and apply_patches() == []
        assert vllm_patches.WorkerExtension().m3jax_patches() == [p.name for p in (*PATCHES,
                                                                                   *vllm_patches.RAY_CPU_PATCHES)]
    finally:  # the rest of this process keeps the unpatched platform
        CpuPlatform.ray_device_key = key
        ray_executor_v2.RayWorkerProc.get_node_and_physical_gpu_ids = ids
