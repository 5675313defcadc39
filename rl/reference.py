"""The KL's reference policy: a frozen copy of the weights the run started from (`grpo.kl` set), or of the policy at
its last reset (`grpo.reference_reset_every_steps`).

Its only reader is the reference logprob pass before each update, so between passes it need not take device
memory. With `grpo.reference_memory: host` the copy lives in the devices' pinned host memory (JAX's memory
kinds: every shard in its own device's host memory, cut as the params are) and is brought onto the devices for
the pass alone; the train step's peak then holds no reference (NeMo-RL keeps its reference on the CPU for the
same reason). `device` keeps it on the devices, as the params are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

REFERENCE_MEMORY = ("device", "host")
HOST_KIND = "pinned_host"


def host_kinds(params) -> set[str]:
    """The memory kinds every device holding `params` offers (the kinds all of them share)."""
    devices = {d for leaf in jax.tree.leaves(params) for d in leaf.sharding.device_set}
    kinds = None
    for d in devices:
        offered = {m.kind for m in d.addressable_memories()}
        kinds = offered if kinds is None else kinds & offered
    return kinds or set()


class ReferenceWeights:
    """The reference policy's params, held in `memory` ("device" or "host"); `for_pass()` gives them on the
    devices, placed as the params were when the copy was made."""

    def __init__(self, params, memory: str = "device"):
        self.reset(params, memory)

    def reset(self, params, memory: str | None = None, mix: float = 1.0) -> None:
        """Hold a copy of `params` as the reference from now on (`grpo.reference_reset_every_steps`: ProRL's
        reference reset to the current policy); the previous copy is dropped. mix < 1 (`grpo.reference_reset_mix`,
        TRL's ref_model_mixup_alpha): the reference becomes mix * params + (1 - mix) * reference instead, computed
        in fp32 and rounded to the params' dtype, in the old reference's buffers."""
        owned = mix != 1.0
        if owned:  # the old reference's buffers (or the pass's copy of them) are donated to the mix
            params = _mixed(params, self.for_pass(), mix)
        memory = self.memory if memory is None else memory
        if memory not in REFERENCE_MEMORY:
            raise ValueError(f"grpo.reference_memory = {memory!r}: expected one of {REFERENCE_MEMORY}")
        self.memory = memory
        self.held = None  # the old copy goes before the new one is made: never two references at once
        self._on_device = jax.tree.map(lambda x: x.sharding, params)
        if memory == "device":  # its own buffers: the train step donates the params'
            self.held = params if owned else jax.tree.map(jnp.copy, params)
            return
        offered = host_kinds(params)
        if HOST_KIND not in offered:
            platform = next(iter(jax.tree.leaves(params)[0].sharding.device_set)).platform
            raise ValueError(f"grpo.reference_memory = host keeps the KL reference in the devices' {HOST_KIND} "
                             f"memory; the {platform} devices here offer {sorted(offered)}: use "
                             f"grpo.reference_memory = device")
        # a transfer into another memory space: new buffers, so the train step's donation cannot reach them
        self.held = jax.device_put(params, jax.tree.map(lambda s: s.with_memory_kind(HOST_KIND), self._on_device))

    def for_pass(self):
        """The params on the devices for one reference pass. From host memory this is a fresh copy that lives
        as long as the caller holds it (the pass), then goes."""
        if self.memory == "device":
            return self.held
        return jax.device_put(self.held, self._on_device)

    def nbytes_per_device(self) -> int:
        """Bytes of the reference one device holds (in `memory`)."""
        leaves = jax.tree.leaves(self.held)
        per_device = {}
        for leaf in leaves:
            for shard in leaf.addressable_shards:
                per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
        return max(per_device.values(), default=0)


@functools.partial(jax.jit, static_argnums=2, donate_argnums=1)
def _mixed(params, reference, mix: float):
    return jax.tree.map(lambda p, r: (mix * p.astype(jnp.float32) + (1 - mix) * r.astype(jnp.float32)).astype(p.dtype),
                        params, reference)
