"""Flax layers of the decoder: shared blocks, family blocks and the decoder stack."""
