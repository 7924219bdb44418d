"""Checkpoints: the Orbax manager with save and restore, params in either layer layout, restoring once per replica set,
full disks, and serving checkpoints."""
