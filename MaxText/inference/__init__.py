"""Decoding with the training model: prefill, sampling, generation, and its memory roofline."""
