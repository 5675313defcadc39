"""A stateless torch.distributed process group for the collective weight path (rl.generation.collective).

Its own TCPStore rendezvous and a `ProcessGroupGloo` (CPU tensors) or `ProcessGroupNCCL` (CUDA tensors)
object built directly on it, not the process-global default group: vLLM owns that one in each engine
process, and the trainer must not need a global init (NeMo-RL's stateless group does the same).
"""

from __future__ import annotations

import datetime


class WeightGroup:
    """A stateless process group: its own TCPStore rendezvous and backend object, no global state."""

    def __init__(self, host: str, port: int, rank: int, world: int, backend: str, timeout_s: float):
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        # Rank 0 serves the store without waiting for the others, so it can hand out the port first.
        self.store = dist.TCPStore(host, port, world, rank == 0, timeout=timeout, wait_for_workers=False)
        self.port, self.rank, self.world, self.backend = self.store.port, rank, world, backend
        self._host, self._timeout = host, timeout
        self.pg = None

    def connect(self) -> "WeightGroup":
        """Blocks until every rank has connected (a collective)."""
        import torch.distributed as dist

        if self.backend == "gloo":
            self.pg = dist.ProcessGroupGloo(self.store, self.rank, self.world, self._timeout)
        elif self.backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(self.store, self.rank, self.world)
        else:
            raise ValueError(f"weight group backend {self.backend!r}: expected gloo or nccl")
        return self

    def broadcast(self, tensor, root: int = 0):
        return self.pg.broadcast(tensor, root)

    def close(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "abort"):
            try:
                pg.abort()  # peers blocked in a collective fail now instead of at the timeout
            except Exception:  # noqa: BLE001 - gloo has no abort in some builds: dropping it closes the sockets
                pass
        self.store = None
