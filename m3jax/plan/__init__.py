"""Mesh planning: analytic per-device memory, FLOPs, communication and step time for a run config,
a sweep over meshes, and an XLA compile check on simulated devices (`python -m m3jax.plan`)."""
