"""Checks on config values that need no devices. Each failure names the key, the value and what is valid."""

import math

from MaxText import common_types
from MaxText.errors import ConfigError

_CHOICES = {
  "decoder_block": common_types.DECODER_BLOCKS,
  "attention": common_types.ATTENTION_KERNELS,
  "remat_policy": common_types.REMAT_POLICIES,
  "dtype": common_types.DTYPES,
  "weight_dtype": common_types.DTYPES,
  "dataset_type": common_types.DATASET_TYPES,
  "opt_type": common_types.OPTIMIZERS,
  "hardware": common_types.HARDWARE,
  "xla_flags_preset": common_types.XLA_FLAGS_PRESETS,
  "jax_distributed_init": common_types.JAX_DISTRIBUTED_INIT,
  "nonfinite_action": common_types.NONFINITE_ACTIONS,
  "quantization": common_types.QUANTIZATIONS,
  "fp8_scaling": common_types.FP8_SCALINGS,
  "kv_quant_axis": common_types.KV_QUANT_AXES,
  "kv_quant_dtype": common_types.KV_QUANT_DTYPES,
  "step_watchdog": common_types.STEP_WATCHDOG,
  "profiler": common_types.PROFILERS,
  "compile_search": common_types.COMPILE_SEARCHES,
  "decode_sampling_strategy": common_types.DECODE_SAMPLING_STRATEGIES,
}

_POSITIVE_INTS = (
  "base_emb_dim",
  "base_num_query_heads",
  "base_num_kv_heads",
  "base_mlp_dim",
  "base_num_decoder_layers",
  "head_dim",
  "vocab_size",
  "max_target_length",
  "gradient_accumulation_steps",
  "log_period",
  "rope_min_timescale",
  "rope_max_timescale",
  "stack_trace_interval_seconds",
  "step_watchdog_min_seconds",
  "profiler_steps",
  "distributed_init_timeout",
  "num_experts",
  "num_experts_per_tok",
  "max_prefill_predict_length",
  "fp8_amax_history_length",
)

_WEEK_SECONDS = 7 * 24 * 3600
# key -> (low, high, low_inclusive, high_inclusive)
_RANGES = {
  "per_device_batch_size": (0.0, math.inf, False, True),
  "learning_rate": (0.0, math.inf, True, True),
  "adam_b1": (0.0, 1.0, True, False),
  "adam_b2": (0.0, 1.0, True, False),
  "adam_eps": (0.0, math.inf, True, True),
  "adam_eps_root": (0.0, math.inf, True, True),
  "adam_weight_decay": (0.0, math.inf, True, True),
  "gradient_clipping_threshold": (0.0, math.inf, True, True),
  "warmup_steps_fraction": (0.0, 1.0, True, True),
  "cosine_learning_rate_final_fraction": (0.0, 1.0, True, True),
  "dropout_rate": (0.0, 1.0, True, False),
  "normalization_layer_epsilon": (0.0, math.inf, False, True),
  "query_pre_attn_scalar": (0.0, math.inf, True, True),
  "attn_logits_soft_cap": (0.0, math.inf, True, True),
  "final_logits_soft_cap": (0.0, math.inf, True, True),
  "rope_scaling_factor": (0.0, math.inf, True, True),
  "load_balance_loss_weight": (0.0, math.inf, True, True),
  "decode_sampling_temperature": (0.0, math.inf, False, True),
  "step_watchdog_factor": (1.0, math.inf, True, True),
  "stack_trace_interval_seconds": (1, _WEEK_SECONDS, True, True),  # a longer wait overflows the thread's timer
  "step_watchdog_min_seconds": (1, _WEEK_SECONDS, True, True),
}


def _describe_range(low, high, low_inc, high_inc) -> str:
  left = ">=" if low_inc else ">"
  if high == math.inf:
    return f"{left} {low:g}"
  return f"in {'[' if low_inc else '('}{low:g}, {high:g}{']' if high_inc else ')'}"


def _check_choices(v):
  for key, valid in _CHOICES.items():
    if v[key] not in valid:
      names = ", ".join(choice or '"" (none)' for choice in valid)
      raise ConfigError(f"{key}={v[key]} is not valid; choose one of: {names}")


def _check_numbers(v):
  for key in _POSITIVE_INTS:
    if v[key] <= 0:
      raise ConfigError(f"{key}={v[key]} must be a positive integer")
  for key, (low, high, low_inc, high_inc) in _RANGES.items():
    x = v[key]
    ok = (x >= low if low_inc else x > low) and (x <= high if high_inc else x < high)
    if not ok or math.isnan(x):
      raise ConfigError(f"{key}={x} must be {_describe_range(low, high, low_inc, high_inc)}")
  scale = v["global_parameter_scale"]
  if scale < 1 or scale & (scale - 1):
    raise ConfigError(f"global_parameter_scale={scale} must be a power of 2 (1, 2, 4, 8, ...)")
  if v["base_num_query_heads"] % v["base_num_kv_heads"]:
    raise ConfigError(
      f"base_num_query_heads={v['base_num_query_heads']} must be a multiple of "
      f"base_num_kv_heads={v['base_num_kv_heads']} (grouped-query attention)"
    )
  if v["steps"] <= 0 and v["steps"] != -1:
    raise ConfigError(f"steps={v['steps']} must be positive (or -1 for learning_rate_schedule_steps)")
  if v["learning_rate_schedule_steps"] <= 0 and v["learning_rate_schedule_steps"] != -1:
    raise ConfigError(f"learning_rate_schedule_steps={v['learning_rate_schedule_steps']} must be positive (or -1 for steps)")
  if v["steps"] == -1 and v["learning_rate_schedule_steps"] == -1:
    raise ConfigError("steps=-1 needs a positive learning_rate_schedule_steps")
  if v["head_dim"] % 2:
    raise ConfigError(f"head_dim={v['head_dim']} must be even (rotary embeddings rotate pairs of dimensions)")
  if v["param_scan_axis"] not in (0, 1):
    raise ConfigError(f"param_scan_axis={v['param_scan_axis']} must be 0 or 1")
  if v["reuse_example_batch"] not in (0, 1):
    raise ConfigError(f"reuse_example_batch={v['reuse_example_batch']} must be 0 or 1")
  if v["num_experts_per_tok"] > v["num_experts"]:
    raise ConfigError(
      f"num_experts_per_tok={v['num_experts_per_tok']} must not exceed num_experts={v['num_experts']} (top-k routing)"
    )
  if math.isnan(v["capacity_factor"]):
    raise ConfigError("capacity_factor=nan must be a number (<= 0: dropless; > 0: tokens per expert x that factor)")
  if v["rope_min_timescale"] > v["rope_max_timescale"]:
    raise ConfigError(
      f"rope_min_timescale={v['rope_min_timescale']} must not exceed rope_max_timescale={v['rope_max_timescale']}"
    )


def _check_layer_options(v):
  if v["sliding_window_size"] < 0:
    raise ConfigError(f"sliding_window_size={v['sliding_window_size']} must be >= 0 (0: no window)")
  positions = v["trainable_position_size"]
  if positions != -1 and positions < v["max_target_length"]:
    raise ConfigError(
      f"trainable_position_size={positions} must be -1 (no learned positions) or at least "
      f"max_target_length={v['max_target_length']}"
    )
  if v["rope_scaling_factor"] > 0:
    low, high = v["rope_scaling_low_freq_factor"], v["rope_scaling_high_freq_factor"]
    if not 0 < low < high:
      raise ConfigError(
        f"rope_scaling_low_freq_factor={low} and rope_scaling_high_freq_factor={high} must satisfy 0 < low < high"
      )
    if v["rope_scaling_original_max_position_embeddings"] <= 0:
      raise ConfigError(
        f"rope_scaling_original_max_position_embeddings={v['rope_scaling_original_max_position_embeddings']} "
        "must be a positive integer"
      )
  if v["fused_qkv"] and v["base_num_query_heads"] != v["base_num_kv_heads"]:
    raise ConfigError(
      f"fused_qkv=true needs base_num_query_heads={v['base_num_query_heads']} equal to "
      f"base_num_kv_heads={v['base_num_kv_heads']} (one kernel for query, key and value)"
    )
  per_block = common_types.DECODER_LAYERS_PER_BLOCK.get(v["decoder_block"], 1)
  if v["base_num_decoder_layers"] % per_block:
    raise ConfigError(
      f"base_num_decoder_layers={v['base_num_decoder_layers']} must be a multiple of {per_block} for "
      f"decoder_block={v['decoder_block']} (its scanned block holds {per_block} layers)"
    )


def _check_activations(v):
  acts = v["mlp_activations"]
  if not acts or not all(isinstance(a, str) for a in acts):
    raise ConfigError(f"mlp_activations={acts} must be a non-empty list of names, e.g. [silu,linear]")
  for a in acts:
    if a not in common_types.MLP_ACTIVATIONS:
      raise ConfigError(f"mlp_activations has unknown activation '{a}'; valid: {', '.join(common_types.MLP_ACTIVATIONS)}")


def _check_mesh(v):
  axes = v["mesh_axes"]
  for axis in axes:
    if axis not in common_types.MESH_AXIS_KEY:
      raise ConfigError(f"mesh_axes has unknown axis '{axis}'; valid: {', '.join(common_types.MESH_AXIS_KEY)}")
  if len(set(axes)) != len(axes):
    raise ConfigError(f"mesh_axes={axes} names an axis twice")
  for prefix in ("ici", "dcn"):
    fills = []
    for axis in axes:
      key = f"{prefix}_{common_types.MESH_AXIS_KEY[axis]}_parallelism"
      if v[key] == -1:
        fills.append(key)
      elif v[key] < 1:
        raise ConfigError(f"{key}={v[key]} must be a positive integer, or -1 to fill the remaining devices")
    if len(fills) > 1:
      raise ConfigError(f"only one {prefix}_*_parallelism may be -1, got {', '.join(fills)}")
  if v["ici_pipeline_parallelism"] > 1 or v["dcn_pipeline_parallelism"] > 1:
    raise ConfigError(
      "ici_pipeline_parallelism/dcn_pipeline_parallelism > 1: pipeline parallelism is not implemented yet; use 1"
    )
  sharding = v["data_sharding"]
  if not (isinstance(sharding, list) and len(sharding) == 1 and isinstance(sharding[0], list)):
    raise ConfigError(f"data_sharding={sharding} must be a list holding one list of mesh axes, e.g. [[data, fsdp]]")
  for axis in sharding[0]:
    if axis not in axes:
      raise ConfigError(f"data_sharding names '{axis}', which is not in mesh_axes ({', '.join(axes)})")
  for rule in v["logical_axis_rules"]:
    if not (isinstance(rule, (list, tuple)) and len(rule) == 2 and isinstance(rule[0], str)):
      raise ConfigError(f"logical_axis_rules entry {rule} must be [logical_name, mesh_axis or [mesh_axes]]")
    targets = rule[1] if isinstance(rule[1], (list, tuple)) else [rule[1]]
    for axis in targets:
      if axis is not None and axis not in axes:
        raise ConfigError(f"logical_axis_rules maps '{rule[0]}' to '{axis}', which is not in mesh_axes ({', '.join(axes)})")


def check_run_name(name: str, origin: str = "") -> None:
  """Outputs go to base_output_directory/run_name: the name must stay one directory below it.

  Args:
    name: the run name.
    origin: where it came from when that is not obvious (e.g. the JOBSET_NAME variable), for the message.
  """
  if "/" in name or "\\" in name or name in (".", ".."):
    given = f"run_name={name}" + (f" (from {origin})" if origin else "")
    raise ConfigError(
      f"{given} must be a single directory name, without '/', '\\', '.' or '..': outputs go to "
      "base_output_directory/run_name"
    )


def _check_paths(v):
  check_run_name(v["run_name"])
  if not str(v["base_output_directory"]).strip():
    raise ConfigError("base_output_directory is empty; give a local directory or a gs:// path")
  if v["load_parameters_path"] and v["load_full_state_path"]:
    raise ConfigError("load_parameters_path and load_full_state_path are both set; give at most one")


def _check_data(v):
  if v["num_epoch"] != -1 and v["num_epoch"] < 1:
    raise ConfigError(f"num_epoch={v['num_epoch']} must be a positive integer, or -1 to repeat forever")
  if v["grain_worker_count"] < 0:
    raise ConfigError(f"grain_worker_count={v['grain_worker_count']} must be >= 0")
  if v["eval_per_device_batch_size"] < 0:
    raise ConfigError(
      f"eval_per_device_batch_size={v['eval_per_device_batch_size']} must be >= 0 (0: per_device_batch_size)"
    )
  if v["eval_steps"] == 0 or v["eval_steps"] < -1:
    raise ConfigError(f"eval_steps={v['eval_steps']} must be positive, or -1 for the whole eval split")
  if v["target_eval_loss"] < 0:
    raise ConfigError(f"target_eval_loss={v['target_eval_loss']} must be >= 0 (0: no early stop)")
  kind = v["dataset_type"]
  if kind == "grain" and not v["grain_train_files"]:
    raise ConfigError("dataset_type=grain needs grain_train_files (';'-separated globs of ArrayRecord files)")
  if kind == "hf" and not v["hf_path"]:
    raise ConfigError("dataset_type=hf needs hf_path, e.g. hf_path=parquet hf_train_files=/data/*.parquet")
  if v["eval_interval"] > 0:
    if kind == "synthetic":
      raise ConfigError("eval_interval > 0 needs real data: dataset_type=synthetic has no eval split")
    if kind == "grain" and not v["grain_eval_files"]:
      raise ConfigError("eval_interval > 0 with dataset_type=grain needs grain_eval_files")
    if kind == "hf" and not (v["hf_eval_files"] or v["hf_eval_split"]):
      raise ConfigError("eval_interval > 0 with dataset_type=hf needs hf_eval_files or hf_eval_split")
  elif v["target_eval_loss"] > 0:
    raise ConfigError(f"target_eval_loss={v['target_eval_loss']} needs eval_interval > 0")


def _check_checkpointing(v):
  if v["checkpoint_period"] < 1:
    raise ConfigError(f"checkpoint_period={v['checkpoint_period']} must be a positive integer")
  keep = v["max_num_checkpoints_to_keep"]
  if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
    raise ConfigError(f"max_num_checkpoints_to_keep={keep} must be null (keep all) or a positive integer")


def _check_decoding(v):
  strategy = v["decode_sampling_strategy"]
  if strategy == "nucleus" and not 0 < v["decode_sampling_nucleus_p"] <= 1:
    raise ConfigError(
      f"decode_sampling_nucleus_p={v['decode_sampling_nucleus_p']} must be in (0, 1] for decode_sampling_strategy=nucleus"
    )
  if strategy == "topk" and not 1 <= v["decode_sampling_top_k"] <= v["vocab_size"]:
    raise ConfigError(
      f"decode_sampling_top_k={v['decode_sampling_top_k']} must be in [1, vocab_size={v['vocab_size']}] for "
      "decode_sampling_strategy=topk"
    )


def _check_diagnostics(v):
  skip = v["skip_first_n_steps_for_profiler"]
  if skip < 0:
    raise ConfigError(f"skip_first_n_steps_for_profiler={skip} must be >= 0")
  steps = v["steps"] if v["steps"] != -1 else v["learning_rate_schedule_steps"]
  if v["profiler"] and skip >= steps:
    raise ConfigError(
      f"profiler={v['profiler']} with skip_first_n_steps_for_profiler={skip} skips every one of the {steps} steps; "
      "lower it or raise steps"
    )
  if v["use_vertex_tensorboard"]:
    if not v["vertex_tensorboard_region"]:
      raise ConfigError("use_vertex_tensorboard=true needs vertex_tensorboard_region, e.g. us-central1")
    if not v["enable_tensorboard"]:
      raise ConfigError(
        "use_vertex_tensorboard=true uploads the TensorBoard directory, which enable_tensorboard=false leaves empty"
      )


def validate_static(values: dict) -> None:
  """Raises ConfigError for the first invalid value. Needs no devices and no JAX."""
  _check_choices(values)
  _check_numbers(values)
  _check_activations(values)
  _check_layer_options(values)
  _check_mesh(values)
  _check_paths(values)
  _check_checkpointing(values)
  _check_data(values)
  _check_decoding(values)
  _check_diagnostics(values)
