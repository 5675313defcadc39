import os

# Tests run on the CPU; 8 simulated devices let sharding tests build real meshes. Must be set before jax loads.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
