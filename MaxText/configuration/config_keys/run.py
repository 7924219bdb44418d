"""Keys of base.yml's Run section: naming, outputs, logging and the diagnostics of a run."""

from MaxText.configuration.common_types import (
  HARDWARE,
  JAX_DISTRIBUTED_INIT,
  NONFINITE_ACTIONS,
  PROFILERS,
  STEP_WATCHDOG,
  XLA_FLAGS_PRESETS,
)
from MaxText.configuration.config_keys import NON_NEGATIVE, POSITIVE, Key, On, Range

# A longer wait overflows the timer of the thread that waits.
_WAIT = Range(1, 7 * 24 * 3600)
_STACK_TRACES = On("collect_stack_trace", True)
_WATCHDOG = On("step_watchdog", "auto", "true")
_PROFILER = On("profiler", "xplane", "nsys")
_VERTEX = On("use_vertex_tensorboard", True)
_WANDB = On("enable_wandb", True)

SECTIONS = {
  "Run": {
    "run_name": Key("Outputs go to base_output_directory/run_name; required by train.py. Empty: $JOBSET_NAME."),
    "model_name": Key("default: the model keys of this file; otherwise the preset configs/models/<name>.yml over them."),
    "override_model_config": Key("Let command-line and M_<KEY> values win over the same keys of the model preset."),
    "hardware": Key("The devices to run on; auto: those JAX finds.", choices=HARDWARE),
    "xla_flags_preset": Key(
      "Tuned XLA flags put before XLA_FLAGS (yours win); a3mega: A3 Mega H100 (runtime/xla_flag_presets.py).",
      choices=XLA_FLAGS_PRESETS,
    ),
    "base_output_directory": Key(
      "Outputs go to <it>/<run_name>/{tensorboard,checkpoints,metrics}: a local directory (from the cwd) or a gs:// path."
    ),
    "steps": Key(
      "Train steps; -1: learning_rate_schedule_steps.",
      range=Range(1, also=(-1,), says="positive (or -1 for learning_rate_schedule_steps)"),
    ),
    "log_period": Key("TensorBoard flush period, in steps.", range=POSITIVE),
    "log_all_processes": Key("Print info (config, step lines) on every process, not only process 0."),
    "enable_tensorboard": Key("Write TensorBoard summaries to <run_dir>/tensorboard (process 0)."),
    "metrics_file": Key(
      "Local JSON-lines file, a line per step (eval/* where an eval followed); plot_metrics.py plots it; empty: none."
    ),
    "jax_cache_dir": Key("Persistent compilation cache; empty disables it."),
    "init_weights_seed": Key("PRNG seed of the parameter init (and of dropout, folded with the step)."),
    # Hang diagnosis
    "collect_stack_trace": Key("Dump every thread's stack every stack_trace_interval_seconds and on a crash."),
    "stack_trace_to_cloud": Key(
      "Dump to /tmp/debugging/ (uploaded to Cloud Logging on TPU VMs) instead of stderr.", acts_with=_STACK_TRACES
    ),
    "stack_trace_interval_seconds": Key("Seconds between stack dumps.", range=_WAIT, acts_with=_STACK_TRACES),
    "step_watchdog": Key(
      "Dump stacks and name the processes behind when a step overruns; auto: on for multi-process jobs.",
      choices=STEP_WATCHDOG,
    ),
    "step_watchdog_factor": Key(
      "A step overruns after this many times the median step time (and step_watchdog_min_seconds).",
      range=Range(1),
      acts_with=_WATCHDOG,
    ),
    "step_watchdog_min_seconds": Key("The least seconds after which a step overruns.", range=_WAIT, acts_with=_WATCHDOG),
    # Profiler
    "profiler": Key(
      "xplane: a jax.profiler trace in <run>/tensorboard/plugins/profile/; nsys: an nsys capture range.",
      choices=PROFILERS,
    ),
    "upload_all_profiler_results": Key("Profile every process, not only process 0.", acts_with=_PROFILER),
    "skip_first_n_steps_for_profiler": Key(
      "Steps of the run before the profile starts.", range=NON_NEGATIVE, acts_with=_PROFILER
    ),
    "profiler_steps": Key("Steps profiled.", range=POSITIVE, acts_with=_PROFILER),
    # Vertex AI TensorBoard
    "use_vertex_tensorboard": Key("Upload tensorboard_dir to a Vertex AI TensorBoard while training (process 0)."),
    "vertex_tensorboard_project": Key("The Vertex AI project; empty: the credentials' project.", acts_with=_VERTEX),
    "vertex_tensorboard_region": Key(
      "The Vertex AI region, e.g. us-central1; required with use_vertex_tensorboard.", acts_with=_VERTEX
    ),
    # Weights & Biases
    "enable_wandb": Key("Log the step and eval metrics to Weights & Biases (process 0); needs `pip install wandb`."),
    "wandb_project": Key("The W&B project; empty: maxtext.", acts_with=_WANDB),
    "wandb_run_name": Key("The W&B run's name (and id, so that a resume continues it); empty: run_name.", acts_with=_WANDB),
    # Multi-process jobs
    "jax_distributed_init": Key(
      "jax.distributed: auto (when the environment describes a multi-process job) | always | never.",
      choices=JAX_DISTRIBUTED_INIT,
    ),
    "distributed_init_timeout": Key(
      "Seconds for every process to join before an error naming the coordinator.", range=POSITIVE
    ),
    "distributed_heartbeat_timeout": Key(
      "Seconds without a heartbeat after which a process is lost: the others stop with one line naming it (exit 75).",
      range=POSITIVE,
    ),
    # Numerics
    "numerics_debug_config": Key(
      "YAML file selecting dense layers whose GEMM statistics are logged (docs/diagnostics.md); empty: off."
    ),
    "nonfinite_action": Key(
      "A NaN/Inf in the loss or gradients: abort | skip (keep the state, warn) | none (no check).",
      choices=NONFINITE_ACTIONS,
    ),
  },
}
