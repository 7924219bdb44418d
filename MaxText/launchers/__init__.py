"""The launchers' logic; the entry points are multihost_runner.py and multihost_job.py at the repository root.

- commands.py: the ssh, scp, gcloud, gsutil and tar commands they run, with every user value checked or quoted.
- workers.py: the workers of an existing cluster (TPU VMs by name, or ssh hosts) and copying the code to them.
- runner.py: one command on every worker, output streamed, and a failing worker stopping the others.
- queued_job.py: a queued resource of TPU slices whose startup script runs one command on every worker.

None of them imports jax: the launchers start in a fraction of a second.
"""
