"""The collective weight path into the workers of a Ray-executor engine (engines across hosts).

An engine on vLLM's Ray executor (`generation.vllm_executor: ray`) holds its model in one worker per rank,
possibly on other machines than the engine's actor, so an update staged by the actor (/dev/shm) does not
reach them. On the `collective` transport each worker therefore joins the weight groups itself, one per
sender, each the group of its route (`rl.generation.weight_routes`: a worker of an expert-parallel engine
receives only the routed experts it holds, and of every other tensor the tensor-parallel slice its loaders
read: rl.generation.weight_slices). It verifies every bucket (XXH3, name /
shape / dtype against the served checkpoint, the set it should hold complete) and keeps it staged; the
commit writes the staged tensors in each worker through vLLM's own name mapping and TP slicing (each rank
keeps its own slice; an expert of another rank is skipped by vLLM's loader): in place, one copy into the
loaded parameters plus the oneDNN re-pack (`rl.generation.inplace`), when the applier covers the worker's
model (`m3jax_setup_apply`), else vLLM's `reload_weights`. An update staged under /dev/shm (executor mp,
or ray on one host) is written the same way (`m3jax_write_weights`).
Phase 1 and 2 are the same as for an in-process engine (rl.generation.collective): a rejected bucket on
any worker aborts the update on every engine, before any worker has written a weight.

The methods below are collective_rpc targets mixed into vLLM's worker class (`_WorkerExtension`). A worker
answers phase 1 with {"buckets": n} or {"error": text}, not an exception, so that the engine can raise the
TransferError with the tensor's name (an exception crossing vLLM's executor arrives wrapped).
"""

from __future__ import annotations

import numpy as np

from rl.generation.torch_arrays import to_torch


def manifest_check(manifest: dict, source: str):
    """check(name, shape, dtype): raise ValueError unless `name` is a tensor of the served checkpoint
    (manifest: name -> (shape, dtype)) with this shape and dtype; source names the checkpoint."""

    def check(name: str, shape, dtype) -> None:
        if name not in manifest:
            raise ValueError(f"tensor {name!r} is not a tensor of the served checkpoint {source} "
                             "(vLLM's M3 loader would skip it silently)")
        want_shape, want_dtype = manifest[name]
        if tuple(shape) != tuple(want_shape) or np.dtype(dtype) != np.dtype(want_dtype):
            raise ValueError(f"tensor {name!r}: got shape {tuple(shape)} {np.dtype(dtype)}, the checkpoint "
                             f"has {tuple(want_shape)} {np.dtype(want_dtype)}")

    return check


class WorkerWeights:
    """A vLLM worker's end of the collective weight group (mixed into `_WorkerExtension`)."""

    _m3jax_receiver = None
    _m3jax_applier = None  # rl.generation.inplace.InplaceApplier once the engine chose the in-place apply

    def m3jax_setup_apply(self) -> str | None:
        """Build the in-place applier for this worker's model: None when it covers every layer (kept, and
        used by every later write), else why not (this worker keeps `reload_weights`)."""
        from rl.generation.inplace import covering_applier

        applier, why = covering_applier(self.model_runner.model)
        if why is not None:
            return f"worker {self.rank}: {why}"
        self._m3jax_applier = applier
        return None

    def m3jax_drop_apply(self) -> None:
        """Back to `reload_weights` (another rank is not covered: the engine's ranks apply alike)."""
        self._m3jax_applier = None

    def m3jax_write_weights(self, tensors) -> None:
        """Write (HF name, torch tensor) pairs, the whole served set: in place when set up, else through vLLM's
        `reload_weights` (names mapped, this rank's slice taken, the layers' post-load processing re-run)."""
        if self._m3jax_applier is not None:
            self._m3jax_applier.apply(tensors)
        else:
            self.reload_weights(weights_iterator=tensors, is_checkpoint_format=True)

    def m3jax_local_experts(self) -> list[int] | None:
        """The routed experts this worker holds (global ids), or None when it holds all of them (no expert
        parallelism) or its MoE layers are placed differently from each other (then it receives every one)."""
        held = {tuple(m.expert_map_manager.get_local_expert_ids()) for m in self.model_runner.model.modules()
                if getattr(m, "expert_map_manager", None) is not None}
        if len(held) != 1:
            return None
        experts = list(held.pop())
        total = {m.expert_map_manager.global_num_experts for m in self.model_runner.model.modules()
                 if getattr(m, "expert_map_manager", None) is not None}
        return None if {len(experts)} == total else experts

    def m3jax_weight_route(self, manifest: dict) -> dict:
        """What this worker reads of the served checkpoint (manifest: name -> (shape, dtype)): the routed
        experts it holds (`m3jax_local_experts`) and the box of each other tensor its loaders read only a
        slice of (its tensor-parallel rank's: rl.generation.weight_slices), probed on the loaded layout: the
        in-place applier's buffers, or, for a worker on reload_weights (e.g. a GPU MoE kernel the applier does
        not cover), those of an applier built for the probe alone (on CUDA the live parameters themselves;
        the same loaders read the same boxes under reload_weights). Where no applier can be built, whole."""
        from rl.generation.weight_routes import expert_of, wants

        experts = self.m3jax_local_experts()
        applier = self._m3jax_applier
        if applier is None:
            from rl.generation.inplace import InplaceApplier

            try:
                applier = InplaceApplier(self.model_runner.model)  # its loaded-layout buffers, dropped after
            except Exception:  # noqa: BLE001 - vLLM internals it reads are missing: every tensor whole
                return {"experts": experts, "slices": {}}
        names = [n for n in manifest if wants(None if experts is None else set(experts), n) and expert_of(n) is None]
        boxes = applier.read_boxes(manifest, names)
        return {"experts": experts, "slices": {n: [list(ab) for ab in box] for n, box in boxes.items()}}

    def m3jax_join_weight_group(self, senders_by_route, placement, routes, backend: str, timeout_s: float) -> int:
        """Join this worker's route's group of every sender (placement is indexed by the worker's rank)."""
        from rl.generation.collective_receiver import Receiver

        if self._m3jax_receiver is None:
            self._m3jax_receiver = Receiver()
        return self._m3jax_receiver.join_placed(senders_by_route, placement, routes, self.rank, backend, timeout_s)

    def m3jax_leave_weight_group(self) -> None:
        if self._m3jax_receiver is not None:
            self._m3jax_receiver.leave()

    def m3jax_receive_weights(self, version: int, manifest: dict, source: str) -> dict:
        """Phase 1: every bucket of `version` received, verified and complete -> {"buckets": n}, else
        {"error": the TransferError's text} (the stream drained, nothing staged)."""
        from rl.generation.transfer_base import TransferError

        if self._m3jax_receiver is None:
            return {"error": f"worker {self.rank} is not in a weight group (version {version})"}
        try:
            return {"buckets": self._m3jax_receiver.receive(version, manifest_check(manifest, source), manifest)}
        except TransferError as e:
            return {"error": str(e)}

    def m3jax_commit_weights(self, version: int, num_buckets: int) -> None:
        """Phase 2: write the staged tensors (`m3jax_write_weights`), then drop them."""
        receiver = self._m3jax_receiver
        try:
            self.m3jax_write_weights((name, to_torch(a)) for name, a in receiver.tensors(version, num_buckets))
        finally:
            receiver.clear()

    def m3jax_abort_weights(self, version: int) -> None:
        if self._m3jax_receiver is not None and self._m3jax_receiver.version == version:
            self._m3jax_receiver.clear()
