"""The M3 model: pure math (norms, rope, attention, indexer, mlp, moe), parameter specs, the NNX model
(`m3jax.model.decoder.M3ForCausalLM`, also `m3jax.M3ForCausalLM`)."""
