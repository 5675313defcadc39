"""Checks 9 and 10 of scripts/gpu_check.py: the collective weight path's pieces that run on a GPU without NCCL.

NCCL needs a GPU per rank, so one lent GPU cannot run a group; what it can run is everything around the wire.
9. the word checksum (rl.generation.word_checksum) on CUDA against the CPU's values, a flipped byte caught,
   and its GB/s beside XXH3 on one host core;
10. a push through a loopback wire (`Loopback`: the sender's broadcasts are handed to the receiver's in this
   process): JAX arrays on the device packed into CUDA buckets by DLPack, checksummed there, received into CUDA
   buffers, verified there and staged on the device or, through the ring, in host memory, then compared with
   the source bit for bit, with the seconds it took.
Each returns its result as a dict (gpu_check prints it). `device="cpu"` runs check 10 on host buffers with the
device options forced: what its test does off a GPU.
"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np


class Loopback:
    """A weight group's two ends in one process: what the sender broadcasts, the receiver's broadcast gets."""

    class _Done:
        def wait(self):
            return None

    class _End:
        def __init__(self, wire: queue.Queue, sending: bool):
            self.wire, self.sending = wire, sending

        def broadcast(self, tensor, root: int = 0):
            if self.sending:
                self.wire.put(tensor.clone())
            else:
                tensor.copy_(self.wire.get(timeout=60))
            return Loopback._Done()

        def close(self):
            pass

    def __init__(self):
        wire: queue.Queue = queue.Queue()
        self.sender, self.receiver = self._End(wire, True), self._End(wire, False)


def device_checksum(small: bool) -> dict:
    """Check 9: word_checksums of the same bytes on CUDA and on the CPU, and their speed on CUDA."""
    import torch
    import xxhash

    from rl.generation.word_checksum import word_checksums
    if not torch.cuda.is_available():
        return {"check": "device_checksum", "skipped": "no CUDA device visible to torch"}
    nbytes = (16 if small else 1024) << 20
    host = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    spans = [(o, min(nbytes - o, (3 << 20) + 2)) for o in range(0, nbytes, 4 << 20)]  # 3 MB + a 2-byte tail each
    dev = host.cuda()
    want, got = word_checksums(host, spans), word_checksums(dev, spans)
    dev[spans[-1][0] + 5] ^= 1
    caught = word_checksums(dev, spans)[-1] != got[-1]
    dev[spans[-1][0] + 5] ^= 1
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        word_checksums(dev, spans)
    dt = (time.perf_counter() - t) / 5
    t = time.perf_counter()
    xxhash.xxh3_64_intdigest(host.numpy())
    dx = time.perf_counter() - t
    return {"check": "device_checksum", "bytes": nbytes, "spans": len(spans), "equal_to_cpu": got == want,
            "flip_caught": caught, "cuda_gb_s": sum(n for _, n in spans) / dt / 1e9,
            "xxh3_host_gb_s": nbytes / dx / 1e9}


def _named_arrays(small: bool, seed: int = 0):
    """HF-like tensors on JAX's default device: bf16 and fp32, one with an odd byte count, one past a bucket."""
    import jax
    import jax.numpy as jnp

    k = jax.random.split(jax.random.key(seed), 4)
    n = 256 if small else 4096
    return [("model.embed_tokens.weight", jax.random.normal(k[0], (n, 64 if small else 1024), jnp.bfloat16)),
            ("model.norm.weight", jax.random.normal(k[1], (7,), jnp.bfloat16)),  # 14 bytes: a word tail
            ("model.layers.0.mlp.down_proj.weight", jax.random.normal(k[2], (n, n // 2), jnp.float32)),
            ("lm_head.weight", jax.random.normal(k[3], (n, 32 if small else 1024), jnp.bfloat16))]


def weight_push_device(small: bool, device: str | None = None) -> dict:
    """Check 10 (see the module doc), for each staging of the receiver."""
    import torch

    from rl.generation import collective_receiver, word_checksum
    from rl.generation.bucket_sender import BucketSender, RoutedSender
    from rl.generation.torch_arrays import numpy_dtype, to_numpy

    if device is None:
        if not torch.cuda.is_available():
            return {"check": "weight_push_device", "skipped": "no CUDA device visible to torch"}
        device = "cuda"
    named = _named_arrays(small)
    want = {n: np.asarray(a) for n, a in named}
    manifest = {n: (tuple(a.shape), numpy_dtype(a)) for n, a in named}
    bucket = (64 << 10) if small else (64 << 20)
    out = {"check": "weight_push_device", "device": device, "bytes": sum(a.nbytes for a in want.values())}
    for staging in ("device", "host"):
        wire = Loopback()
        sender = RoutedSender(bucket, device=device, checksum_kind=word_checksum.KIND)
        sender.routes, sender.slices, sender.senders = [None], [{}], [BucketSender(bucket, device=device,
                                                                                   checksum_kind=word_checksum.KIND)]
        sender.senders[0].group = wire.sender
        receiver = collective_receiver.Receiver(staging)
        receiver.groups, receiver.device = [wire.receiver], ("cuda:0" if device == "cuda" else device)
        got: dict = {}

        def receive(receiver=receiver):
            try:
                got["buckets"] = receiver.receive(1, lambda name, shape, dtype: None, manifest)
            except Exception as e:  # noqa: BLE001 - reported in the result
                got["error"] = f"{type(e).__name__}: {e}"

        t = time.perf_counter()
        thread = threading.Thread(target=receive)
        thread.start()
        sent = sender.send(iter(named), 1)
        thread.join(timeout=120)
        seconds = time.perf_counter() - t
        row = {"seconds": seconds, "send_error": sent.error, "receive_error": got.get("error")}
        if "buckets" in got:
            arrived = dict(receiver.tensors(1, got["buckets"]))
            row["bit_for_bit"] = all(
                n in arrived and to_numpy(arrived[n]).view(np.uint8).tobytes() == w.view(np.uint8).tobytes()
                for n, w in want.items())
            row["on"] = sorted({str(a.device) for a in arrived.values()})
            row["gb_s"] = out["bytes"] / seconds / 1e9
        out[staging] = row
    return out
