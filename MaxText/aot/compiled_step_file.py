"""A compiled train step on disk (compiled_trainstep_file): written by train_compile.py, loaded by train.py.

The file holds the serialized executable and the signature it was compiled for: the config values the step
depends on (shapes, mesh, model, optimizer and learning-rate schedule, which are baked into the program), the
target's device kind and count, and the jax version. train.py compares that signature with its own config and
devices before loading, so a mismatch is one line naming what differs, not an error from deep inside XLA.
"""

import pickle

import jax

from MaxText.errors import UserError

FORMAT_VERSION = 1

# Keys that do not change the compiled step: where outputs and data come from, checkpointing, logging, eval and
# the AOT keys themselves. Every other config value is part of the signature.
_OUTSIDE_THE_STEP = {
  "run_name", "model_name", "override_model_config", "hardware", "base_output_directory", "run_dir", "tensorboard_dir",
  "checkpoint_dir", "metrics_dir", "config_path", "steps", "log_period", "log_all_processes", "enable_tensorboard",
  "metrics_file", "jax_cache_dir", "collect_stack_trace", "stack_trace_to_cloud", "stack_trace_interval_seconds",
  "step_watchdog", "step_watchdog_factor", "step_watchdog_min_seconds", "profiler", "upload_all_profiler_results",
  "skip_first_n_steps_for_profiler", "profiler_steps", "use_vertex_tensorboard", "vertex_tensorboard_project",
  "vertex_tensorboard_region",
  "jax_distributed_init", "distributed_init_timeout", "distributed_heartbeat_timeout", "enable_checkpointing",
  "async_checkpointing", "checkpoint_period", "max_num_checkpoints_to_keep",
  "load_parameters_path", "load_full_state_path", "force_unroll", "dataset_type", "tokenizer_path", "add_bos",
  "add_eos", "packing", "num_epoch", "enable_data_shuffling", "data_shuffle_seed", "reuse_example_batch",
  "train_data_column", "eval_data_column", "tokenize_train_data", "tokenize_eval_data", "dataset_path",
  "dataset_name", "eval_dataset_name", "train_split", "eval_split", "grain_train_files", "grain_eval_files",
  "grain_worker_count", "hf_path", "hf_data_dir", "hf_train_files", "hf_eval_files", "hf_eval_split", "hf_access_token",
  "eval_interval", "eval_steps", "eval_per_device_batch_size", "target_eval_loss", "global_batch_size_to_load_eval",
  "compile_topology", "compile_topology_num_slices", "compiled_trainstep_file", "compile_search",
  "numerics_debug_config",  # the file's content is in the derived key numerics_debug, which is in the signature
  "save_checkpoint_on_completion", "data_position_on_resume", "gcs_metrics", "save_config_to_gcs",
  "use_sft", "sft_train_on_completion_only", "use_chat_template", "chat_template", "train_data_columns",  # the data's
}  # fmt: skip


def step_signature(config, devices) -> dict:
  """What a compiled step depends on: the config values that shape it, the devices and the jax version."""
  # A parsed value (numerics_debug) by its content, not its Python object.
  values = {k: v.to_plain() if hasattr(v, "to_plain") else v for k, v in sorted(config.get_keys().items())}
  values = {k: v for k, v in values.items() if k not in _OUTSIDE_THE_STEP}
  values["device_kind"] = devices[0].device_kind
  values["jax_version"] = jax.__version__
  return values


def save(path: str, compiled, config, devices) -> int:
  """Writes the compiled step and its signature; returns the file's size in bytes."""
  from jax.experimental import serialize_executable  # pylint: disable=import-outside-toplevel

  serialized, _, _ = serialize_executable.serialize(compiled)
  payload = {"format": FORMAT_VERSION, "signature": step_signature(config, devices), "executable": serialized}
  data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
  try:
    with open(path, "wb") as f:
      f.write(data)
  except OSError as e:
    raise UserError(f"cannot write compiled_trainstep_file={path}: {e.strerror or e}") from None
  return len(data)


def _read(path: str) -> dict:
  try:
    with open(path, "rb") as f:
      payload = pickle.load(f)
  except FileNotFoundError:
    raise UserError(f"compiled_trainstep_file={path} does not exist (write it with MaxText/train_compile.py)") from None
  except Exception as e:  # pylint: disable=broad-except  # unpickling arbitrary bytes can raise anything
    raise UserError(f"compiled_trainstep_file={path} is not a compiled train step of train_compile.py: {e}") from None
  if not isinstance(payload, dict) or payload.get("format") != FORMAT_VERSION:
    raise UserError(f"compiled_trainstep_file={path} is not a compiled train step written by this train_compile.py")
  return payload


def _differences(compiled_for: dict, here: dict, config) -> list[str]:
  """The values that differ, those the user set first (derived ones, like global batch sizes, follow from them)."""
  keys = sorted(set(compiled_for) | set(here), key=lambda k: (k in config and config.source(k) == "derived", k))
  return [
    f"{key}={here.get(key, '(none)')} here but {compiled_for.get(key, '(none)')} in the file"
    for key in keys
    if compiled_for.get(key) != here.get(key)
  ]


def load(path: str, config, devices, train_step_fn, abstract_state, abstract_batch):
  """The compiled step of `path`, checked against this run's config and devices.

  Args:
    path: compiled_trainstep_file.
    config: this run's Config.
    devices: the devices the step will run on (jax.devices()).
    train_step_fn: the step as a function of (state, batch), to rebuild the output tree (nothing compiles).
    abstract_state, abstract_batch: the step's arguments as sharded jax.ShapeDtypeStructs.

  Returns:
    A callable compiled(state, batch) -> (new_state, metrics), as aot_compile.compile_train_step returns.

  Raises:
    UserError: the file is missing or unreadable, or was compiled for other shapes, values or devices.
  """
  from jax.experimental import serialize_executable  # pylint: disable=import-outside-toplevel

  payload = _read(path)
  differences = _differences(payload["signature"], step_signature(config, devices), config)
  if differences:
    shown = "; ".join(differences[:6]) + (f"; and {len(differences) - 6} more" if len(differences) > 6 else "")
    raise UserError(
      f"compiled_trainstep_file={path} was compiled for another run: {shown}. Run with the values it was compiled "
      "for, or compile again with MaxText/train_compile.py"
    )
  in_tree = jax.tree.structure(((abstract_state, abstract_batch), {}))
  out_tree = jax.tree.structure(jax.eval_shape(train_step_fn, abstract_state, abstract_batch))
  return serialize_executable.deserialize_and_load(payload["executable"], in_tree, out_tree, execution_devices=devices)
