from m3jax.model.decoder import M3ForCausalLM

__all__ = ["M3ForCausalLM"]
