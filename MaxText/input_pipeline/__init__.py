"""Input pipelines: every dataset_type yields the same dict of global (batch, length) arrays."""
