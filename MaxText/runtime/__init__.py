"""The processes and devices a run runs on: jax.distributed from the cluster, the mesh and shardings, compile targets,
heartbeats between processes, preemption, goodput and the test-only faults."""
