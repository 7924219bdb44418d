"""Checks on config values that need no devices. Each failure names the key, the value and what is valid.

The choices and ranges of single keys are those of config_schema; the functions below add the rules that a range
cannot say (a power of 2, an even number) and those between keys.
"""

from MaxText.configuration import common_types, config_loader, config_schema
from MaxText.errors import ConfigError


def _check_choices(v):
  for key, entry in config_schema.KEYS.items():
    if entry.choices and not isinstance(v[key], (list, tuple)) and v[key] not in entry.choices:
      raise ConfigError(f"{key}={v[key]} is not valid; choose one of: {entry.describe_choices()}")


# Upstream values of refused keys that say what this config does anyway: (key, value) -> (key, value) that makes it so.
_UPSTREAM_VALUES_THAT_HOLD = {("attention_type", "mla"): ("decoder_block", "deepseek")}


def _check_upstream_defaults(v):
  """Upstream MaxText's keys for features that do not apply here: their default loads, another value is refused."""
  defaults = config_loader.base_defaults()
  for key, entry in config_schema.KEYS.items():
    holds = _UPSTREAM_VALUES_THAT_HOLD.get((key, v[key])) if isinstance(v[key], str) else None
    if entry.refused and v[key] != defaults[key] and not (holds and v[holds[0]] == holds[1]):
      raise ConfigError(f"{key}={config_loader.show_value(v[key])}: {entry.refused}")


def _check_ranges(v):
  for key, entry in config_schema.KEYS.items():
    integer = config_schema.kind(key, v[key]) == "int"
    if entry.range is not None and not entry.range.contains(v[key], integer):
      raise ConfigError(f"{key}={v[key]} must be {entry.range.describe(integer)}")


def _check_numbers(v):
  scale = v["global_parameter_scale"]
  if scale & (scale - 1):
    raise ConfigError(f"global_parameter_scale={scale} must be a power of 2 (1, 2, 4, 8, ...)")
  if v["base_num_query_heads"] % v["base_num_kv_heads"]:
    raise ConfigError(
      f"base_num_query_heads={v['base_num_query_heads']} must be a multiple of "
      f"base_num_kv_heads={v['base_num_kv_heads']} (grouped-query attention)"
    )
  if v["steps"] == -1 and v["learning_rate_schedule_steps"] == -1:
    raise ConfigError("steps=-1 needs a positive learning_rate_schedule_steps")
  if v["head_dim"] % 2:
    raise ConfigError(f"head_dim={v['head_dim']} must be even (rotary embeddings rotate pairs of dimensions)")
  if v["num_experts_per_tok"] > v["num_experts"]:
    raise ConfigError(
      f"num_experts_per_tok={v['num_experts_per_tok']} must not exceed num_experts={v['num_experts']} (top-k routing)"
    )
  if v["rope_min_timescale"] > v["rope_max_timescale"]:
    raise ConfigError(
      f"rope_min_timescale={v['rope_min_timescale']} must not exceed rope_max_timescale={v['rope_max_timescale']}"
    )


def _check_layer_options(v):
  positions = v["trainable_position_size"]
  if positions != -1 and positions < v["max_target_length"]:
    raise ConfigError(
      f"trainable_position_size={positions} must be -1 (no learned positions) or at least "
      f"max_target_length={v['max_target_length']}"
    )
  if v["rope_scaling_factor"] > 0 and v["rope_linear_scaling_factor"] != 1:
    raise ConfigError(
      f"rope_scaling_factor={v['rope_scaling_factor']} (Llama 3.1 scaling) and rope_linear_scaling_factor="
      f"{v['rope_linear_scaling_factor']} are two RoPE scalings; set one (rope_linear_scaling_factor=1 is off)"
    )
  if v["rope_scaling_factor"] > 0:
    low, high = v["rope_scaling_low_freq_factor"], v["rope_scaling_high_freq_factor"]
    if not 0 < low <= high:
      raise ConfigError(
        f"rope_scaling_low_freq_factor={low} and rope_scaling_high_freq_factor={high} must satisfy 0 < low <= high"
      )
  if v["fused_qkv"] and v["base_num_query_heads"] != v["base_num_kv_heads"]:
    raise ConfigError(
      f"fused_qkv=true needs base_num_query_heads={v['base_num_query_heads']} equal to "
      f"base_num_kv_heads={v['base_num_kv_heads']} (one kernel for query, key and value)"
    )
  per_block = common_types.layers_per_block(v["decoder_block"])
  if v["base_num_decoder_layers"] % per_block:
    raise ConfigError(
      f"base_num_decoder_layers={v['base_num_decoder_layers']} must be a multiple of {per_block} for "
      f"decoder_block={v['decoder_block']} (its scanned block holds {per_block} layers)"
    )


def _check_deepseek(v):
  """DeepSeek-V3's routing groups and dense layers fit; what its latent attention does not do is refused by name."""
  if v["rope_type"] == "yarn" and v["decoder_block"] not in ("deepseek", "gpt_oss"):
    raise ConfigError(
      f"rope_type=yarn is for multi-head latent attention (decoder_block=deepseek) and gpt_oss, not {v['decoder_block']}"
    )
  if v["decoder_block"] != "deepseek":
    return
  if v["first_num_dense_layers"] > v["base_num_decoder_layers"]:
    raise ConfigError(
      f"first_num_dense_layers={v['first_num_dense_layers']} must not exceed base_num_decoder_layers="
      f"{v['base_num_decoder_layers']}"
    )
  experts, groups, chosen = v["num_experts"], v["n_routing_groups"], v["topk_routing_group"]
  if experts % groups:
    raise ConfigError(f"n_routing_groups={groups} must divide num_experts={experts}")
  if chosen > groups:
    raise ConfigError(f"topk_routing_group={chosen} must not exceed n_routing_groups={groups}")
  if v["num_experts_per_tok"] > chosen * experts // groups:
    raise ConfigError(
      f"num_experts_per_tok={v['num_experts_per_tok']} exceeds the experts of topk_routing_group={chosen} groups "
      f"({chosen * experts // groups})"
    )
  unsupported = {
    "quantize_kvcache": v["quantize_kvcache"],
    "sliding_window_size": v["sliding_window_size"],
    "fused_qkv": v["fused_qkv"],
    "rope_scaling_factor": v["rope_scaling_factor"] > 0 and v["rope_scaling_factor"],
    "rope_linear_scaling_factor": v["rope_linear_scaling_factor"] != 1 and v["rope_linear_scaling_factor"],
  }
  for key, value in unsupported.items():
    if value:
      raise ConfigError(f"{key}={value} is not supported with decoder_block=deepseek (multi-head latent attention)")


def _check_llama4(v):
  """What Llama 4's layers cannot do is refused by name (cuDNN's mask: attention_selection)."""
  if v["decoder_block"] != "llama4":
    return
  if v["num_experts_per_tok"] != 1:
    raise ConfigError(
      f"num_experts_per_tok={v['num_experts_per_tok']}: decoder_block=llama4 routes each token to 1 expert (its "
      "router's sigmoid scales the expert's input, which needs one input per token)"
    )
  context = v["ici_context_parallelism"] * v["dcn_context_parallelism"]
  if v["chunk_attn_window_size"] > 0 and v["context_parallel_strategy"] == "ring" and context != 1:
    raise ConfigError("context_parallel_strategy=ring does not mask Llama 4's chunks; use all_gather")


def _check_activations(v):
  acts, valid = v["mlp_activations"], config_schema.KEYS["mlp_activations"]
  if not acts or not all(isinstance(a, str) for a in acts):
    raise ConfigError(f"mlp_activations={acts} must be a non-empty list of names, e.g. [silu,linear]")
  for a in acts:
    if a not in valid.choices:
      raise ConfigError(f"mlp_activations has unknown activation '{a}'; valid: {valid.describe_choices()}")


def _check_mesh(v):
  axes, valid = v["mesh_axes"], config_schema.KEYS["mesh_axes"]
  for axis in axes:
    if axis not in valid.choices:
      raise ConfigError(f"mesh_axes has unknown axis '{axis}'; valid: {valid.describe_choices()}")
  if len(set(axes)) != len(axes):
    raise ConfigError(f"mesh_axes={axes} names an axis twice")
  for prefix in ("ici", "dcn"):
    fills = []
    for axis in axes:
      key = f"{prefix}_{common_types.MESH_AXIS_KEY[axis]}_parallelism"
      if v[key] == -1:  # other values below 1 are out of the key's range
        fills.append(key)
    if len(fills) > 1:
      raise ConfigError(f"only one {prefix}_*_parallelism may be -1, got {', '.join(fills)}")
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
  if str(v["base_output_directory"]) != str(v["base_output_directory"]).strip():
    raise ConfigError(f"base_output_directory='{v['base_output_directory']}' has leading or trailing spaces")
  if v["load_parameters_path"] and v["load_full_state_path"] and not v["enable_lora"]:  # LoRA: the base + its state
    raise ConfigError("load_parameters_path and load_full_state_path are both set; give at most one")


def _check_emergency_checkpoint(v):
  if not v["enable_emergency_checkpoint"]:
    return
  if not v["enable_checkpointing"]:
    raise ConfigError(
      "enable_emergency_checkpoint=true needs enable_checkpointing=true: the local tier saves between the persistent "
      "tier's checkpoints, and a restart falls back to them"
    )
  if not v["local_checkpoint_directory"]:
    raise ConfigError(
      "enable_emergency_checkpoint=true needs local_checkpoint_directory: a directory on each host's own disk (a RAM "
      "disk or local SSD), e.g. local_checkpoint_directory=/local/checkpoints"
    )
  if v["local_checkpoint_period"] <= 0:
    raise ConfigError(
      f"enable_emergency_checkpoint=true needs local_checkpoint_period > 0 (it is {v['local_checkpoint_period']}): the "
      f"steps between local saves, fewer than checkpoint_period={v['checkpoint_period']}"
    )


_HF_FILE_BUILDERS = ("json", "parquet", "csv", "text", "arrow")


def _check_data(v):
  if v["use_multimodal"] and v["dataset_type"] != "synthetic" and not (v["use_sft"] and not v["packing"]):
    raise ConfigError(
      f"use_multimodal=true reads image-text chat records: set use_sft=true and packing=false (one sample and its "
      f"images per row), with dataset_type={v['dataset_type']}"
    )
  kind = v["dataset_type"]
  defaults = config_loader.base_defaults()
  if v["train_data_column"] != defaults["train_data_column"] and v["train_data_columns"] != defaults["train_data_columns"]:
    raise ConfigError(
      f"train_data_column={v['train_data_column']} and train_data_columns={v['train_data_columns']} are both set: "
      "give one (train_data_column is the one-column shorthand)"
    )
  if kind == "grain" and not v["grain_train_files"]:
    raise ConfigError("dataset_type=grain needs grain_train_files (';'-separated globs of ArrayRecord files)")
  if kind == "hf" and not v["hf_path"]:
    raise ConfigError("dataset_type=hf needs hf_path, e.g. hf_path=parquet hf_train_files=/data/*.parquet")
  if kind == "hf" and v["hf_path"] in _HF_FILE_BUILDERS and not (v["hf_train_files"] or v["hf_data_dir"]):
    # datasets' file builders with no files read every file of the current directory
    raise ConfigError(f"dataset_type=hf hf_path={v['hf_path']} needs hf_train_files, e.g. hf_train_files='/data/*.jsonl'")
  if v["eval_interval"] > 0:
    if kind == "synthetic":
      raise ConfigError("eval_interval > 0 needs real data: dataset_type=synthetic has no eval split")
    if kind == "grain" and not v["grain_eval_files"]:
      raise ConfigError("eval_interval > 0 with dataset_type=grain needs grain_eval_files")
    if kind == "hf" and not (v["hf_eval_files"] or v["hf_eval_split"]):
      raise ConfigError("eval_interval > 0 with dataset_type=hf needs hf_eval_files or hf_eval_split")
  elif v["target_eval_loss"] > 0:
    raise ConfigError(f"target_eval_loss={v['target_eval_loss']} needs eval_interval > 0")


def _check_serving_checkpoint(v):
  """decode.py's quantized serving checkpoints (upstream's keys)."""
  for key in ("save_quantized_params_path", "checkpoint_is_quantized"):
    if v[key] and v["quantization"] != "int8":
      raise ConfigError(
        f"{key} needs quantization=int8 (the checkpoint holds int8 kernels), not quantization='{v['quantization']}'"
      )
  if v["checkpoint_is_quantized"] and not v["load_parameters_path"]:
    raise ConfigError(
      "checkpoint_is_quantized=true reads load_parameters_path: name the directory that save_quantized_params_path wrote"
    )
  if v["checkpoint_is_quantized"] and v["save_quantized_params_path"]:
    raise ConfigError("save_quantized_params_path quantizes float params: not with checkpoint_is_quantized=true")


def _check_decoding(v):
  strategy = v["decode_sampling_strategy"]
  if strategy == "nucleus" and not 0 <= v["decode_sampling_nucleus_p"] <= 1:  # 0: the top token only, as upstream
    raise ConfigError(
      f"decode_sampling_nucleus_p={v['decode_sampling_nucleus_p']} must be in [0, 1] for decode_sampling_strategy=nucleus"
    )
  if strategy == "topk" and not 1 <= v["decode_sampling_top_k"] <= v["vocab_size"]:
    raise ConfigError(
      f"decode_sampling_top_k={v['decode_sampling_top_k']} must be in [1, vocab_size={v['vocab_size']}] for "
      "decode_sampling_strategy=topk"
    )


def _check_diagnostics(v):
  skip = v["skip_first_n_steps_for_profiler"]
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


def _check_multimodal(v):
  """Gemma 3's images: the decoder, the encoder's dims, and the layouts whose attention sees the images' mask."""
  if not v["use_multimodal"]:
    return
  if v["decoder_block"] != "gemma3":
    raise ConfigError(f"use_multimodal=true needs decoder_block=gemma3 (Gemma 3's vision encoder), not {v['decoder_block']}")
  size, patch = v["image_size_for_vit"], v["patch_size_for_vit"]
  side, tokens = size // patch, v["mm_tokens_per_image"]
  tokens_side = round(tokens**0.5)
  if size % patch or tokens_side**2 != tokens or side % tokens_side:
    raise ConfigError(
      f"image_size_for_vit={size}, patch_size_for_vit={patch} and mm_tokens_per_image={tokens}: the patch size must "
      f"divide the image, and the tokens be a square whose side divides the patches' ({side})"
    )
  if v["hidden_size_for_vit"] % v["num_attention_heads_for_vit"]:
    raise ConfigError(
      f"num_attention_heads_for_vit={v['num_attention_heads_for_vit']} must divide "
      f"hidden_size_for_vit={v['hidden_size_for_vit']}"
    )
  if not 0 <= v["image_token_id"] < v["vocab_size"]:
    raise ConfigError(
      f"image_token_id={v['image_token_id']} must be a token of the vocabulary (vocab_size={v['vocab_size']})"
    )
  for key in ("ici_pipeline_parallelism", "dcn_pipeline_parallelism"):
    if v.get(key, 1) != 1:
      raise ConfigError(f"use_multimodal=true does not run pipelined yet ({key}={v[key]}); shard over fsdp or tensor")
  if (
    v.get("context_parallel_strategy") == "ring"
    and v.get("ici_context_parallelism", 1) * v.get("dcn_context_parallelism", 1) != 1
  ):
    raise ConfigError(
      "use_multimodal=true with context parallelism needs context_parallel_strategy=all_gather (ring's mask has no images)"
    )


def validate_model(values: dict) -> None:
  """The checks that a model's keys pass, alone and together (choices, ranges, heads, layers, activations): of a
  second model (a distillation teacher) whose keys are set over a config already validated and resolved."""
  _check_choices(values)
  _check_ranges(values)
  _check_numbers(values)
  _check_activations(values)
  _check_layer_options(values)
  _check_deepseek(values)
  _check_llama4(values)
  _check_multimodal(values)


def validate_static(values: dict, reads_data: bool = True) -> None:
  """Raises ConfigError for the first invalid value (of the data keys only when the entry point reads_data). Needs no
  devices and no JAX."""
  _check_upstream_defaults(values)
  validate_model(values)
  _check_mesh(values)
  _check_paths(values)
  _check_emergency_checkpoint(values)
  if reads_data:
    _check_data(values)
  _check_decoding(values)
  _check_serving_checkpoint(values)
  _check_diagnostics(values)
