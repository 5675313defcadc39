"""Killing an engine process while it works, shared by the real-engine pool tests."""

import os
import signal
import threading
import time


def kill_when_busy(pool, pid: int, timeout_s: float) -> threading.Thread:
    """Start (and return) a thread that SIGKILLs process `pid` as soon as the pool's engine 0 reports a request
    in progress (`health()["busy_s"]`), polling every 5 ms for at most `timeout_s`; join it after the rollout."""
    import ray

    def run():
        actor = pool.slots[0].actor
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if ray.get(actor.health.remote())["busy_s"] is not None:
                os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.005)

    killer = threading.Thread(target=run)
    killer.start()
    return killer
