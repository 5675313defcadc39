"""sharding/cpu_threads.py: NPROC = three times the simulated devices, so that XLA:CPU's collectives among them
always find a thread for every device's share; and the test processes run with it (tests/conftest.py)."""

import os

from sharding.cpu_threads import reserve_collective_threads


def test_three_times_the_simulated_devices_unless_nproc_is_set():
    env = {"XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=8"}
    assert reserve_collective_threads(env) == 24 and env["NPROC"] == "24"
    assert reserve_collective_threads(env) is None and env["NPROC"] == "24"  # set: the caller's (or ours) stays
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_force_host_platform_device_count=4"}
    assert reserve_collective_threads(env) == 12  # XLA takes the last
    for flags in ("", "--xla_force_host_platform_device_count=1"):  # one device: no collective among devices
        env = {"XLA_FLAGS": flags}
        assert reserve_collective_threads(env) is None and "NPROC" not in env
    assert reserve_collective_threads({}) is None


def test_xla_sized_this_process_pools_from_it():
    """XLA reads NPROC once, when jax starts its CPU backend: its intra-op pool (`tf_XLAEigen` threads) has NPROC
    threads, as has the pool that runs each device's share (which is not named). Without NPROC both had 8."""
    import jax
    jax.devices()
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    nproc = int(os.environ["NPROC"])  # 24 from tests/conftest.py, unless the caller set NPROC
    assert names.count("tf_XLAEigen") == max(nproc, 8)
