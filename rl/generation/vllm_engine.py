"""One vLLM engine serving an M3 checkpoint: token ids and numpy in and out, no Ray, so an actor can wrap it.

The engine core always runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`). Its executor is either
  - "uni" (the default for tensor_parallel == 1): the model lives in this process too, so the CPU patches
    (`vllm_patches`) reach it directly and weight updates pass tensors by reference (~0.5 ms/MB);
  - "mp" (needed for tensor_parallel > 1): one spawned worker process per rank. The patches reach the
    workers through `worker_extension_cls`, and an update is written as one safetensors file into a fresh
    directory under /dev/shm that every worker reloads from (collective_rpc would pickle tensors into
    plain lists, stack-notes §8). Workers are spawned, so they re-import the caller's `__main__`: a
    script that builds an "mp" engine needs the `if __name__ == "__main__":` guard (a Ray actor has it);
  - "ray" (ranks on several hosts): one Ray actor per rank, in the placement group of the Ray actor this
    engine runs in (rl.generation.vllm_ray; the pool sets that up). Updates go through /dev/shm as for
    "mp", which only reaches workers on this host: `load_weights` refuses otherwise.
Sampling follows the JAX engine (rl/generation/jax_engine.py): stop only on the request's
stop ids, the stop token is part of the response, and every logprob is under the same transformation
as `rl.generation.base.sampling_logits` (temperature, then top-k, then top-p), which the trainer
recomputes. One engine per process: vLLM keeps process-global state.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from typing import Iterable

import numpy as np

from m3jax.hf.layouts import SKIPPED
from m3jax.hf.shapes import shapes_only, tensor_table
from rl.generation.base import SamplingParams
from rl.generation.pool_config import NO_WEIGHTS, check_temperature
from rl.generation.torch_arrays import numpy_dtype, to_torch
from rl.generation.vllm_patches import ImportPatch, apply_patches, selected_patches
from rl.generation.vllm_ray import host_of
from rl.generation.vllm_results import CPU_REASON, moe_layer_ids, routes_from_vllm
from rl.generation.vllm_staging import staged_checkpoint
from rl.generation.vllm_worker_weights import manifest_check

WORKER_EXTENSION = "rl.generation.vllm_patches.WorkerExtension"
APPLY_MODES = ("auto", "inplace", "reload")


class WeightUpdateError(ValueError):
    """A weight update that would not reproduce the trainer's model; it was not applied."""


def _log_softmax(z: np.ndarray) -> np.ndarray:
    m = np.max(z, axis=-1, keepdims=True)
    return z - (m + np.log(np.sum(np.exp(z - m), axis=-1, keepdims=True)))


def sampling_logprobs(logp: np.ndarray, temperature: float, top_p: float = 1.0, top_k: int = 0) -> np.ndarray:
    """numpy twin of `base.sampling_logits` + log-softmax, on rows of full-vocab logprobs [..., V] (any
    per-row shift of the logits gives the same result). Kept off JAX so the engine never starts XLA."""
    z = logp.astype(np.float32) / np.float32(temperature if temperature > 0 else 1.0)
    if 0 < top_k < z.shape[-1]:
        kth = -np.partition(-z, top_k - 1, axis=-1)[..., top_k - 1:top_k]
        z = np.where(z < kth, -np.inf, z)
    if top_p < 1.0:
        sorted_z = -np.sort(-z, axis=-1)
        probs = np.exp(_log_softmax(sorted_z))
        before = np.cumsum(probs, axis=-1) - probs
        cutoff = np.min(np.where(before < top_p, sorted_z, np.inf), axis=-1, keepdims=True)
        z = np.where(z < cutoff, -np.inf, z)
    return _log_softmax(z)


class VLLMEngine:
    # How load_weights applies an update (set by _setup_apply): "inplace" or "reload", and why not inplace.
    apply_mode, apply_fallback, _applier = "reload", None, None
    worker_hosts: list = []  # executor "ray": (machine, Ray node, pid) per rank
    machine = ""  # this process's machine (rl.generation.vllm_ray.host_of), recorded at start

    def __init__(self, model_dir: str, *, dtype: str = "float32", seed: int = 0, max_model_len: int,
                 tensor_parallel: int = 1, expert_parallel: int = 1, gpu_memory_utilization: float = 0.8,
                 kv_cache_gb: float = 1, executor: str | None = None, weight_apply: str = "auto",
                 return_routes: bool = False):
        """model_dir: a released-layout checkpoint (`m3jax.save_pretrained(model, path, layout="released")`), or its
        shapes alone (`m3jax.hf.save.save_shapes`): the engine then starts from vLLM's dummy weights, holds weight
        version NO_WEIGHTS, and serves the model once its first update arrives.
        expert_parallel: 1, or equal to tensor_parallel (vLLM's expert parallelism spans the TP ranks).
        executor: "uni", "mp" or "ray"; None picks "uni" for one rank and "mp" for more.
        weight_apply: how `load_weights` writes an update. "inplace": one copy into the loaded parameters
        plus the oneDNN re-pack (`rl.generation.inplace`; in this process, or in each worker of the mp and
        ray executors); "reload": vLLM's `reload_weights`; "auto": inplace when it covers every layer of the
        model, else reload (`apply_mode` / `apply_fallback` say which and why).
        return_routes: `generate` also returns each request's MoE routes (`rl.generation.vllm_results`); GPU only."""
        executor = executor or ("uni" if tensor_parallel == 1 else "mp")
        if executor not in ("uni", "mp", "ray"):
            raise ValueError(f"executor={executor!r}: expected 'uni', 'mp' or 'ray'")
        if weight_apply not in APPLY_MODES:
            raise ValueError(f"weight_apply={weight_apply!r}: expected one of {APPLY_MODES}")
        if executor == "uni" and tensor_parallel != 1:
            raise ValueError(f"tensor_parallel={tensor_parallel} needs worker processes: executor='mp'")
        if expert_parallel not in (1, tensor_parallel):
            raise ValueError(f"expert_parallel={expert_parallel}: expected 1 or tensor_parallel={tensor_parallel}")
        self.model_dir = os.path.abspath(model_dir)
        text = self._check_config()
        self.manifest: dict[str, tuple[tuple[int, ...], np.dtype]] = self._read_manifest()
        # a directory of the model's shapes alone (m3jax.hf.shapes): vLLM's dummy weights until the first push
        self.dummy = shapes_only(self.model_dir)
        self.version = NO_WEIGHTS if self.dummy else 0
        self.executor = executor
        self._broken: str | None = None

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gb)
        if executor == "ray":  # the Ray patches of the CPU set (vllm_ray), here and in the workers
            from rl.generation.vllm_ray import EXECUTOR_ENV
            os.environ[EXECUTOR_ENV] = "ray"
        self.patches = apply_patches()
        import torch
        from vllm import LLM
        from vllm.platforms import current_platform
        if return_routes and current_platform.is_cpu():
            raise ValueError(f"return_routes: {CPU_REASON}")
        self.moe_layers = moe_layer_ids(text) if return_routes else None
        self.top_k = text.get("num_experts_per_tok")
        self.vocab_size = int(text["vocab_size"])
        if current_platform.is_cpu() and any((text.get("sparse_attention_config") or {}).get(
                "sparse_attention_freq") or []):
            raise ValueError(f"{self.model_dir}: sparse (lightning-indexer) attention layers have no vLLM CPU "
                             "path; on CPU serve a checkpoint whose sparse_attention_freq is all 0")
        if "OMP_NUM_THREADS" not in os.environ:
            # vLLM serves with one torch thread unless OMP_NUM_THREADS says otherwise, but in-process its
            # CPU worker disables torch.set_num_threads before it gets there; spinning OpenMP threads
            # on a shared, busy CPU made decoding 10-100x slower in tests.
            torch.set_num_threads(1)
        extra = {} if executor == "uni" else {"worker_extension_cls": WORKER_EXTENSION}
        t0 = time.perf_counter()
        with _worker_env(executor, current_platform.is_cpu()):
            self.llm = LLM(
                model=self.model_dir, dtype=dtype, seed=seed, max_model_len=max_model_len,
                tensor_parallel_size=tensor_parallel, enable_expert_parallel=expert_parallel > 1,
                gpu_memory_utilization=gpu_memory_utilization, distributed_executor_backend=executor,
                enforce_eager=True, skip_tokenizer_init=True, **({"load_format": "dummy"} if self.dummy else {}),
                # Logprobs after temperature / top-k / top-p, as the trainer's token_logprobs computes them.
                logprobs_mode="processed_logprobs", max_logprobs=-1,
                limit_mm_per_prompt={"image": 0, "video": 0}, generation_config="vllm",
                **({"enable_return_routed_experts": True} if return_routes else {}), **extra)
        if executor != "uni" and current_platform.is_cpu():
            # Each worker resolved WORKER_EXTENSION before building its model; a worker without the
            # patches would run the wrong math or crash at the first forward.
            want = {p.name for p in selected_patches() if not isinstance(p, ImportPatch) and p.needed()}
            for rank, got in enumerate(self.llm.collective_rpc("m3jax_patches")):
                if want - set(got):
                    self.shutdown()
                    raise RuntimeError(f"vLLM worker {rank} lacks the CPU patches {sorted(want - set(got))}")
        # (machine, Ray node, pid) of every rank: whether /dev/shm staging reaches it; health() reports them
        self.worker_hosts = self.llm.collective_rpc(host_of) if executor == "ray" else []
        self.machine = host_of(None)[0]
        self._setup_apply(weight_apply)
        self.start_seconds = time.perf_counter() - t0
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()

    def _setup_apply(self, want: str) -> None:
        """Pick the weight-apply path: an engine whose every layer (in every worker) the in-place applier
        covers gets it (see rl.generation.inplace), anything else keeps vLLM's reload_weights."""
        if want == "reload":
            return
        if self.executor != "uni":  # each worker process applies its own rank's slice (vllm_worker_weights)
            missing = [why for why in self.llm.collective_rpc("m3jax_setup_apply") if why]
            if not missing:
                self.apply_mode = "inplace"
                return
            self.llm.collective_rpc("m3jax_drop_apply")  # the ranks of one engine apply alike
            why = "; ".join(missing)
        else:
            from rl.generation.inplace import covering_applier
            applier, why = self.llm.apply_model(covering_applier)[0]
            if why is None:
                self.apply_mode, self._applier = "inplace", applier
                return
        if want == "inplace":
            self.shutdown()
            raise ValueError(f"weight_apply='inplace' is not possible here: {why}")
        self.apply_fallback = why  # auto: reload_weights, and the reason is kept for logs / tests

    # ------------------------------------------------------------------------------------ checkpoint
    def _check_config(self) -> dict:
        """The checks vLLM would fail late or not at all; returns the text config."""
        path = os.path.join(self.model_dir, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        vision = cfg.get("vision_config") or {}
        if cfg.get("model_type") != "minimax_m3_vl" or not isinstance(cfg.get("text_config"), dict) \
                or "img_token_compression_config" not in vision:
            raise ValueError(f"{path}: vLLM's M3 loader needs the released layout (model_type minimax_m3_vl, "
                             "a nested text_config, a vision_config with img_token_compression_config): write "
                             "it with m3jax.save_pretrained(model, path, layout='released')")
        text = cfg["text_config"]
        shared = text.get("intermediate_size", 0) * text.get("n_shared_experts", 1)
        if text.get("shared_intermediate_size", shared) != shared:
            raise ValueError(f"{path}: shared_intermediate_size={text['shared_intermediate_size']}, but vLLM sizes "
                             f"the shared expert as intermediate_size x n_shared_experts = {shared}")
        return text

    def _read_manifest(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        # vision / MTP tensors are not served
        return {name: v for name, v in tensor_table(self.model_dir).items() if not SKIPPED.search(name)}

    def check(self, name: str, shape, dtype) -> None:
        """Raise WeightUpdateError unless `name` is a served checkpoint tensor of this shape and dtype."""
        try:
            manifest_check(self.manifest, self.model_dir)(name, shape, dtype)
        except ValueError as e:
            raise WeightUpdateError(str(e)) from None

    def weight_receivers(self) -> list:
        """The ranks this engine takes on the collective weight path, each as what it reads
        (rl.generation.weight_routes.reads: the routed experts it holds, None = all, and its tensor-parallel
        slices): on the Ray executor one per worker, in rank order (they receive themselves:
        rl.generation.vllm_worker_weights), else one that reads everything (this process receives)."""
        if self.executor != "ray":
            return [None]
        self._check_alive()
        return self.llm.collective_rpc("m3jax_weight_route", args=(dict(self.manifest),))

    def commit_in_workers(self, version: int, num_buckets: int) -> None:
        """Phase 2 of a collective update the Ray executor's workers staged: each writes its tensors."""
        self._check_alive()
        self._apply("m3jax_commit_weights", {"version": version, "num_buckets": num_buckets})
        self._forget_old_prefixes()

    # ------------------------------------------------------------------------------------ sampling
    def _params(self, **kw):
        from vllm import SamplingParams as VSP
        # ignore_eos: the trainer puts eos into stop_token_ids itself, as for the JAX engine.
        return VSP(ignore_eos=True, detokenize=False, skip_special_tokens=False, flat_logprobs=True, **kw)

    def _run(self, prompts: list[list[int]], params: list) -> list:
        self._check_alive()
        inputs = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        return self.llm.generate(inputs, params, use_tqdm=False)

    def generate(self, prompts: list[list[int]], sp: SamplingParams, seeds: list[int]
                 ) -> list[tuple]:
        """Per prompt: (response ids incl. the stop token, logprob of each, truncated = no stop token), and
        with return_routes a fourth entry, the routes int16 [prompt + response - 1, n_moe_layers, k]."""
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts: expected one per prompt")
        check_temperature(sp.temperature)
        stops = tuple(int(s) for s in sp.stop_token_ids)
        params = [self._params(max_tokens=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p,
                               top_k=sp.top_k if 0 < sp.top_k < self.vocab_size else 0, seed=int(s), stop_token_ids=list(stops),
                               logprobs=0) for s in seeds]
        out = []
        for prompt, req in zip(prompts, self._run(prompts, params)):
            c = req.outputs[0]
            ids = list(c.token_ids)
            lps = c.logprobs
            # Column 0 of each position is the sampled token (vLLM gathers it first).
            logps = [float(lps.logprobs[lps.start_indices[i]]) for i in range(len(ids))]
            row = (ids, logps, not (ids and ids[-1] in stops))
            if self.moe_layers is not None:
                row += (routes_from_vllm(c.routed_experts, self.moe_layers, len(prompt) + len(ids) - 1, self.top_k),)
            out.append(row)
        if sp.temperature == 0 and (sp.top_k > 0 or sp.top_p < 1):
            # vLLM's greedy path skips top-k/top-p, which the JAX engine's greedy logprobs include.
            scored = self.score(prompts, [o[0] for o in out], 0.0, sp.top_p, sp.top_k)
            out = [(o[0], [float(x) for x in s], *o[2:]) for o, s in zip(out, scored)]
        return out

    def score(self, prompts: list[list[int]], responses: list[list[int]], temperature: float = 1.0,
              top_p: float = 1.0, top_k: int = 0) -> list[np.ndarray]:
        """log p(response[t] | prompt, response[:t]) under the sampling transformation, fp32 [len(response)].

        One prefill per row via prompt logprobs. Those are untransformed, so unless the transformation
        is the identity every row returns full-vocab logprobs (O(vocab) per position: meant for checks
        and small vocabularies, not for scoring a 200k-vocab batch).
        """
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        identity = (temperature in (0, 1)) and top_k == 0 and top_p >= 1
        params = self._params(max_tokens=1, temperature=0.0, prompt_logprobs=0 if identity else -1)
        rows = [list(p) + list(r) for p, r in zip(prompts, responses)]
        out = []
        for req, p, r in zip(self._run(rows, [params] * len(rows)), prompts, responses):
            lps, n = req.prompt_logprobs, len(r)
            positions = range(len(p), len(p) + n)  # position i holds log p(row[i] | row[:i])
            if identity:
                out.append(np.array([lps.logprobs[lps.start_indices[i]] for i in positions], np.float32))
                continue
            full = np.full((n, self.vocab_size), -np.inf, np.float32)
            for j, i in enumerate(positions):
                a, b = lps.start_indices[i] + 1, lps.end_indices[i]  # [target, then the whole vocab]
                full[j, np.asarray(lps.token_ids[a:b])] = lps.logprobs[a:b]
            logp = sampling_logprobs(full, temperature, top_p, top_k)
            out.append(logp[np.arange(n), np.asarray(r, np.int64)].astype(np.float32))
        return out

    # ------------------------------------------------------------------------------------ weights
    def load_weights(self, named_arrays: Iterable[tuple[str, np.ndarray]]) -> None:
        """Replace every served tensor (HF checkpoint names, released layout) in place.

        The whole set is checked before anything is applied: names, shapes and dtypes against the
        checkpoint, no repeats, nothing missing (vLLM reloads a layer only once all its tensors came,
        and would run a layer with some tensors unloaded). A rejected update leaves the engine serving
        the previous weights.
        """
        self._check_alive()
        items = list(named_arrays)
        seen = set()
        for name, array in items:
            self.check(name, np.shape(array), numpy_dtype(array))
            if name in seen:
                raise WeightUpdateError(f"tensor {name!r} appears twice in one update")
            seen.add(name)
        missing = sorted(self.manifest.keys() - seen)
        if missing:
            raise WeightUpdateError(f"incomplete update: {len(missing)} of {len(self.manifest)} tensors missing, "
                                    f"e.g. {missing[:3]}; send every tensor (hf_tensors(model, 'released'))")
        if self._applier is not None:  # one copy into the loaded layout + the oneDNN re-pack
            tensors = ((name, to_torch(array)) for name, array in items)
            try:
                self._applier.apply(tensors)
            except BaseException as e:
                self._broken = f"weight update failed part-way: {type(e).__name__}: {e}"
                raise
        # reload_weights maps checkpoint names onto vLLM's fused parameters and re-runs the per-layer
        # post-load processing; a second bare model.load_weights would not (rl.generation.inplace says why).
        elif self.executor == "uni":
            tensors = ((name, to_torch(array)) for name, array in items)
            self._apply("reload_weights", {"weights_iterator": tensors, "is_checkpoint_format": True})
        else:
            here = self.machine
            if any(h[0] != here for h in self.worker_hosts):  # refused before anything is written
                raise WeightUpdateError(f"workers on hosts {sorted({h[0] for h in self.worker_hosts})} cannot read "
                                        f"an update staged under /dev/shm of {here}: a multi-host engine takes its "
                                        "weights with generation.weight_transport: collective (docs/vllm.md)")
            # Written before anything is applied: a full /dev/shm fails here and the engine stays healthy.
            with staged_checkpoint(items) as path:
                self._apply("m3jax_reload_weights", {"weights_path": path})
        self._forget_old_prefixes()

    def _forget_old_prefixes(self) -> None:
        """Drop the prefix cache's blocks, computed with the old weights. vLLM answers False where it could not (it
        does so while requests run): a later prompt sharing a prefix would then read keys of the old weights
        under the new ones, so the engine is unusable (the pool replaces it), not quietly wrong."""
        if self.llm.reset_prefix_cache() is False:
            self._broken = "vLLM could not reset its prefix cache after a weight update (requests still running?)"
            raise WeightUpdateError(self._broken)

    def _apply(self, method: str, kwargs: dict) -> None:
        try:
            self.llm.collective_rpc(method, kwargs=kwargs)
        except BaseException as e:
            self._broken = f"weight update failed part-way: {type(e).__name__}: {e}"
            raise

    # ------------------------------------------------------------------------------------ life cycle
    def _check_alive(self) -> None:
        self._check_workers()
        if self._broken:
            raise RuntimeError(f"engine unusable: {self._broken}")
        if getattr(self, "llm", None) is None:
            raise RuntimeError("engine was shut down")

    def _check_workers(self) -> None:
        llm = getattr(self, "llm", None)
        executor = getattr(getattr(getattr(llm, "llm_engine", None), "engine_core", None), "engine_core", None)
        if getattr(getattr(executor, "model_executor", None), "is_failed", False) and not self._broken:
            self._broken = "a vLLM worker process died"  # the executor has shut the others down

    def health(self) -> dict:
        self._check_workers()
        ok = self._broken is None and getattr(self, "llm", None) is not None
        return {"ok": ok, "version": self.version, "pid": os.getpid(), **({"error": self._broken} if self._broken else {}),
                "machine": self.machine,
                **({"workers": [{"machine": m, "node": n, "pid": pid} for m, n, pid in self.worker_hosts]}
                   if self.worker_hosts else {})}

    def shutdown(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel
        destroy_model_parallel()
        destroy_distributed_environment()  # so a later engine in this process can initialise again


@contextlib.contextmanager
def _worker_env(executor: str, cpu: bool):
    """Environment for the worker processes `LLM(...)` spawns, restored afterwards.

    vLLM's automatic CPU binding gives each rank its own NUMA node and refuses more ranks than nodes
    ("Not enough allowed NUMA nodes"), and unbound workers default to one OpenMP thread per core each,
    which oversubscribes a shared machine; one thread per rank unless the caller chose otherwise.
    """
    if executor == "uni" or not cpu:
        yield
        return
    want = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    old = {k: os.environ.get(k) for k in want}
    os.environ.update({k: v for k, v in want.items() if old[k] is None})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
