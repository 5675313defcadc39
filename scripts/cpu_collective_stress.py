"""Many collective programs among 8 simulated CPU devices, dispatched back to back: how XLA:CPU's deadlock
(sharding/cpu_threads.py) was reproduced and its remedy checked.

Each round cuts a tiny M3 sharded over the 8 devices into its HF tensors on the devices (`hf_tensors(on_host=False)`
and the owned path, what tests/test_weight_senders.py checks), about a hundred small programs, most with a
collective, and waits for them every 20 rounds. A deadlock ends the process after XLA's 40 s ("Termination timeout
... only 7 of them arrived on time"), so the last round printed is how far it got.

    # beside a busy loop, as the test suite's load:  timeout 1200 sh -c 'while :; do :; done' &
    PYTHONPATH=$PWD NPROC=8  .venv/bin/python scripts/cpu_collective_stress.py --rounds 1500   # XLA's pool here
    PYTHONPATH=$PWD NPROC=16 .venv/bin/python scripts/cpu_collective_stress.py --rounds 1500   # the remedy
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])  # the first paragraph, whole
    parser.add_argument("--rounds", type=int, default=1500)
    args = parser.parse_args(argv)
    import jax

    from m3jax import tiny
    from m3jax.hf.owned import owned_hf_tensors
    from m3jax.hf.save import hf_tensors
    from tests.test_weight_senders import _sharded_over_8

    model = _sharded_over_8(tiny.m3_model(tiny.m3_config(num_local_experts=8), seed=2))
    print(f"NPROC={os.environ.get('NPROC', '(unset)')}, {len(jax.devices())} devices", flush=True)
    start = time.perf_counter()
    for i in range(1, args.rounds + 1):
        got = list(hf_tensors(model, "released", on_host=False))
        got += list(owned_hf_tensors(model, "released", process=0, processes=2, on_host=False))
        if i % 20 == 0 or i == args.rounds:
            jax.block_until_ready([a for _, a in got])
            print(f"round {i}: {time.perf_counter() - start:.1f} s", flush=True)
    print(f"all {args.rounds} rounds done", flush=True)


if __name__ == "__main__":
    main()
