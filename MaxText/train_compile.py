"""Compiles the train step for a TPU pod or GPU cluster from any host, and says whether it fits:

    python3 MaxText/train_compile.py MaxText/configs/base.yml compile_topology=v5e-256 compile_topology_num_slices=2 \\
        global_parameter_scale=16 per_device_batch_size=4

It prints the per-device memory analysis against the target's memory, a verdict line (`fits` with the headroom,
or `does not fit` with the excess), the analytic TFLOPs per step and a roofline estimate of the step time and
MFU. Exit status: 0 fits, 3 does not fit, 2 a configuration error.

compiled_trainstep_file=PATH saves the compiled step; `train.py ... compiled_trainstep_file=PATH` on the target
loads it instead of compiling (same shapes and devices; the learning-rate schedule is baked in).
compile_search=per_device_batch_size[,remat_policy] finds the largest batch that fits (for each remat policy).
Targets: v4-8 ... v4-4096, v5e-1 ... v5e-256, v5p-8 ... v5p-17920, v6e-1 ... v6e-256 (libtpu describes them on
a CPU host: `bash setup.sh DEVICE=tpu`), a3 (needs a GPU host), cpu-N (N devices of this host).
"""

import os
import sys

if __package__ in (None, ""):  # Run as `python3 MaxText/train_compile.py`: import MaxText from this checkout.
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from MaxText import pyconfig  # pylint: disable=wrong-import-position
from MaxText.runtime.entry_point import run_and_exit_on_user_error  # pylint: disable=wrong-import-position

EXIT_DOES_NOT_FIT = 3


def main(argv: list[str]) -> None:
  # pylint: disable=import-outside-toplevel
  from MaxText import max_logging

  max_logging.log("Starting train_compile.py")
  config = pyconfig.initialize(argv, for_compile_topology=True)
  from MaxText.aot import aot_compile, compile_search, compiled_step_file
  from MaxText.configuration import pipeline_schedule

  if schedule := pipeline_schedule.resolve(config.get_keys()):
    max_logging.log(schedule.line())

  if config.compile_search:
    fits = compile_search.run(argv, config)
    sys.exit(0 if fits else EXIT_DOES_NOT_FIT)
  outcome = aot_compile.compile_for_target(config)
  for line in aot_compile.report(outcome):
    max_logging.log(line)
  if not outcome.fits:
    sys.exit(EXIT_DOES_NOT_FIT)
  if config.compiled_trainstep_file:
    size = compiled_step_file.save(config.compiled_trainstep_file, outcome.compiled, config, outcome.devices)
    max_logging.log(
      f"Saved the compiled train step to {config.compiled_trainstep_file} ({size / 2**20:.1f} MiB). On the target, "
      f"run train.py with the same config keys and compiled_trainstep_file={config.compiled_trainstep_file}; the "
      "learning-rate schedule (learning_rate, learning_rate_schedule_steps or steps, warmup) is baked in."
    )


if __name__ == "__main__":
  run_and_exit_on_user_error(main, sys.argv)
