"""MaxText: a simple, scalable LLM training framework in JAX."""
