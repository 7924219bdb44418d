"""Step time of N processes x D/N CPU devices against 1 process x D devices, on one host.

    python3 benchmarks/multiprocess_benchmark.py [--devices 8] [--processes 2] [--steps 20] \
      MaxText/configs/base.yml [key=value ...]

Runs benchmarks/train_step_benchmark.py (the train.py step on one fixed batch) once as a single process and
once as a jax.distributed job on 127.0.0.1 (each process one slice, so dcn_* axes cross processes), and prints
both median step times and their ratio: what the cross-process collectives cost. All processes share this
host's cores, so the ratio is an upper bound of the overhead, not a network measurement.
"""

import argparse
import os
import re
import subprocess
import sys

import portpicker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_BENCHMARK = os.path.join(ROOT, "benchmarks", "train_step_benchmark.py")
_STEP_TIME = re.compile(r"step time ([\d.]+) s")


def _env(devices: int, **extra) -> dict:
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
  env.update(extra)
  return env


def _step_time(output: str, what: str) -> float:
  found = _STEP_TIME.search(output)
  if found is None:
    sys.exit(f"{what} printed no step time:\n{output[-3000:]}")
  return float(found.group(1))


def run(processes: int, devices: int, steps: int, config_args: list[str]) -> float:
  """Median step seconds of the benchmark as `processes` processes holding `devices` devices in all."""
  command = [sys.executable, STEP_BENCHMARK, "--steps", str(steps), *config_args]
  port = portpicker.pick_unused_port()
  procs = []
  for rank in range(processes):
    cluster = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "NNODES": str(processes), "NODE_RANK": str(rank)}
    env = _env(devices // processes, **(cluster if processes > 1 else {}))
    procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  outputs = [p.communicate()[0] for p in procs]
  for rank, (p, output) in enumerate(zip(procs, outputs)):
    if p.returncode:
      sys.exit(f"process {rank} of {processes} failed (exit {p.returncode}):\n{output[-3000:]}")
  return _step_time(outputs[0], f"{processes} x {devices // processes} devices")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--processes", type=int, default=2)
  parser.add_argument("--steps", type=int, default=20)
  args, config_args = parser.parse_known_args()
  if args.processes < 2 or args.devices % args.processes:
    parser.error(f"--processes={args.processes} must be at least 2 and divide --devices={args.devices}")
  one = run(1, args.devices, args.steps, config_args)
  many = run(args.processes, args.devices, args.steps, config_args)
  print(f"1 process x {args.devices} devices: {one:.4f} s/step")
  print(f"{args.processes} processes x {args.devices // args.processes} devices: {many:.4f} s/step")
  print(f"ratio (multi-process / single): {many / one:.3f}")


if __name__ == "__main__":
  main()
