"""Generation with the training model, which decoding (inference/) and reinforcement learning (features/grpo*.py)
share: the prefill and decode step over the KV cache, sampling, and the row sampler."""
