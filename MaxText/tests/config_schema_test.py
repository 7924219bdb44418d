"""The config schema: one entry per key of base.yml, which the validation, the switch warnings and --help read."""

import math
import re

import pytest

from MaxText import pyconfig
from MaxText.configuration import base_yml, common_types, config_loader, config_schema, config_validation
from MaxText.errors import ConfigError
from MaxText.tests.helpers import BASE_YML, TRAIN_PY, run_python

DEFAULTS = config_loader.base_defaults()
RANGED = [name for name, key in config_schema.KEYS.items() if key.range is not None]


def _base_yml_sections() -> dict[str, list[str]]:
  """{section title: its keys} as base.yml lays them out under its `#### Title ####` lines."""
  sections, current = {}, None
  with open(BASE_YML, encoding="utf-8") as f:
    for line in f:
      title = re.fullmatch(r"#{3,} (.+?) #{3,}", line.strip())
      if title:
        current = sections.setdefault(title.group(1), [])
      key = re.match(r"([a-z0-9_]+):", line)
      if key:
        current.append(key.group(1))
  return sections


def _validate(*args, **kwargs) -> None:
  values, _ = config_loader.load_raw_config(["t", BASE_YML, *args], {}, kwargs)
  config_validation.validate_static(values)


def test_one_entry_per_key_of_base_yml_in_its_section_and_order():
  assert sorted(config_schema.KEYS) == sorted(DEFAULTS)
  assert {title: list(keys) for title, keys in config_schema.SECTIONS.items()} == _base_yml_sections()


def test_base_yml_comments_are_the_schema_help_written_once():
  """A key's help lives in its Key; base.yml's comment on the key's line is written from it."""
  with open(BASE_YML, encoding="utf-8") as f:
    text = f.read()
  assert base_yml.render(text) == text, (
    "base.yml's key comments differ from config_keys/: python3 -m MaxText.configuration.base_yml"
  )


def test_a_changed_help_rewrites_its_comment_and_only_it():
  keys = dict(config_schema.KEYS)
  keys["steps"] = config_schema.Key("A much longer help " * 12 + "end.")
  with open(BASE_YML, encoding="utf-8") as f:
    text = f.read()
  new = base_yml.render(text, keys)
  changed = [line for line in new.split("\n") if line not in text.split("\n")]
  assert changed[0].startswith("steps: 150_001  # A much longer help") and changed[-1].endswith("end.")
  assert all(len(line) <= base_yml.WIDTH for line in changed)
  assert base_yml.render(new, keys) == new  # the wrapped lines are its own: rewriting twice changes nothing
  assert base_yml.render(new) == text


@pytest.mark.parametrize("name", list(config_schema.KEYS))
def test_an_entry_agrees_with_its_default(name):
  key, default = config_schema.KEYS[name], DEFAULTS[name]
  assert key.help.strip() and "\n" not in key.help and len(key.help) <= 120
  kind = config_schema.kind(name, default)
  assert kind in ("bool", "int", "float", "str", "list", "mapping")
  if key.choices:
    assert all(item in key.choices for item in (default if kind == "list" else [default]))
  if key.range is not None:
    assert kind in ("int", "float") and key.range.contains(default, kind == "int")
  if key.acts_with is not None:
    switch = config_schema.KEYS[key.acts_with.key]
    assert all(value in (switch.choices or (True, False)) for value in key.acts_with.values)


def test_the_switches_are_those_the_companion_warnings_named():
  assert {str(switch): keys for switch, keys in config_schema.switches().items()} == {
    "collect_stack_trace=true": ["stack_trace_to_cloud", "stack_trace_interval_seconds"],
    "step_watchdog=auto|true": ["step_watchdog_factor", "step_watchdog_min_seconds"],
    "profiler=xplane|nsys": ["upload_all_profiler_results", "skip_first_n_steps_for_profiler", "profiler_steps"],
    "use_vertex_tensorboard=true": ["vertex_tensorboard_project", "vertex_tensorboard_region"],
    "quantization=fp8": ["fp8_scaling", "fp8_amax_history_length"],
    "quantize_kvcache=true": ["kv_quant_axis", "kv_quant_dtype"],
    "use_sft=true": ["sft_train_on_completion_only"],
    "use_dpo=true": ["dpo_beta", "dpo_label_smoothing"],
    "decoder_block=mixtral|qwen3_moe|deepseek|llama4|gpt_oss": [
      "num_experts",
      "num_experts_per_tok",
      "capacity_factor",
      "moe_dispatch",
      "sparse_matmul",
      "load_balance_loss_weight",
    ],
    "remat_policy=custom": list(common_types.REMAT_NAMES),
    "megablox=true": [
      *(
        f"{w}_tile_{p}_{d}"
        for w in ("wi", "wo")
        for p in ("fwd", "dlhs", "drhs")
        for d in ("batch_seq", "embed_dim", "mlp_dim")
      ),
      "tile_batch_seq",
      "tile_embed_dim",
      "tile_mlp_dim",
    ],
    "enable_dropout=true": ["dropout_rate"],
    "opt_type=muon": ["muon_beta", "muon_weight_decay", "muon_consistent_rms"],
    "enable_checkpointing=true": ["async_checkpointing", "checkpoint_period"],
    "enable_lora=true": ["lora_rank", "lora_alpha", "lora_module_path", "lora_weight_qtype"],
    "use_distillation=true": ["distill_alpha", "distill_temperature", "teacher_overrides"],
    "use_grpo=true": [
      "num_generations",
      "num_iterations",
      "grpo_beta",
      "grpo_epsilon",
      "epsilon_high",
      "loss_algo",
      "loss_agg_mode",
      "reward_functions",
      "reward_weights",
      "grpo_samples_interval",
    ],
    "quantization=intmp": ["quant_cfg_path"],
    "quantization=int8": ["quantization_local_shard_count"],
    "enable_jax_profiler=true": ["jax_profiler_port"],
    "enable_wandb=true": ["wandb_project", "wandb_run_name"],
    "enable_goodput_recording=true": ["monitor_goodput", "goodput_upload_interval_seconds"],
    "enable_emergency_checkpoint=true": ["local_checkpoint_directory", "local_checkpoint_period"],
    "decoder_block=gemma3": ["local_rope_max_timescale"],
    "decoder_block=deepseek": [
      "first_num_dense_layers",
      "n_routing_groups",
      "topk_routing_group",
      "routed_scaling_factor",
      "routed_bias_update_rate",
      "q_lora_rank",
      "kv_lora_rank",
      "qk_nope_head_dim",
      "qk_rope_head_dim",
      "v_head_dim",
    ],
    "decoder_block=deepseek|llama4": ["base_moe_mlp_dim", "shared_experts"],
    "decoder_block=llama4": [
      "interleave_moe_layer_step",
      "nope_layer_interval",
      "chunk_attn_window_size",
      "use_qk_norm",
      "temperature_tuning",
    ],
    "temperature_tuning=true": ["temperature_tuning_scale", "temperature_tuning_floor_scale"],
    "decoder_block=deepseek|gpt_oss": ["routed_bias"],
    "decoder_block=gpt_oss": ["mlp_bias", "mlp_activations_limit", "attention_sink"],
    "rope_type=yarn": ["rope_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale"],
    "use_multimodal=true": ["freeze_vision_encoder_params", "dtype_mm"],
  }


def _just_outside(r, integer: bool) -> list:
  values = [r.low if r.low_open else r.low - 1, r.high if r.high_open else r.high + 1]
  values = [int(v) if integer else float(v) for v in values if math.isfinite(v)]
  return [v for v in values if not r.contains(v, integer)] + ([] if integer else [math.nan])


@pytest.mark.parametrize("name", RANGED)
def test_a_value_outside_the_schema_range_is_refused_naming_the_range(name):
  r, integer = config_schema.KEYS[name].range, config_schema.kind(name, DEFAULTS[name]) == "int"
  for value in _just_outside(r, integer):
    with pytest.raises(ConfigError) as error:
      _validate(**{name: value})
    if math.isnan(value):  # refused as it is read, as the user wrote it (.nan)
      assert str(error.value) == f"{name}=.nan must be a finite number (e.g. 0.5 or 3e-4)"
    else:
      assert str(error.value) == f"{name}={value} must be {r.describe(integer)}"


# The messages of the checks that moved into the schema, as they were before.
MESSAGES = [
  ("steps=-5", "steps=-5 must be positive (or -1 for learning_rate_schedule_steps)"),
  ("learning_rate_schedule_steps=0", "learning_rate_schedule_steps=0 must be positive (or -1 for steps)"),
  ("max_target_length=0", "max_target_length=0 must be a positive integer"),
  ("per_device_batch_size=0", "per_device_batch_size=0.0 must be > 0"),
  ("learning_rate=-1", "learning_rate=-1.0 must be >= 0"),
  ("adam_b2=1.0", "adam_b2=1.0 must be in [0, 1)"),
  ("warmup_steps_fraction=1.5", "warmup_steps_fraction=1.5 must be in [0, 1]"),
  ("step_watchdog_factor=0.5", "step_watchdog_factor=0.5 must be >= 1"),
  ("stack_trace_interval_seconds=100000000", "stack_trace_interval_seconds=100000000 must be in [1, 604800]"),
  ("capacity_factor=.nan", "capacity_factor=.nan must be a finite number (e.g. 0.5 or 3e-4)"),
  ("global_parameter_scale=0", "global_parameter_scale=0 must be a power of 2 (1, 2, 4, 8, ...)"),
  ("global_parameter_scale=3", "global_parameter_scale=3 must be a power of 2 (1, 2, 4, 8, ...)"),
  ("sliding_window_size=-1", "sliding_window_size=-1 must be >= 0 (0: no window)"),
  ("ici_tensor_parallelism=0", "ici_tensor_parallelism=0 must be a positive integer, or -1 to fill the remaining devices"),
  ("checkpoint_period=0", "checkpoint_period=0 must be a positive integer"),
  ("max_num_checkpoints_to_keep=0", "max_num_checkpoints_to_keep=0 must be null (keep all) or a positive integer"),
  ("max_num_checkpoints_to_keep=1.5", "max_num_checkpoints_to_keep=1.5 must be null (keep all) or a positive integer"),
  ("num_epoch=0", "num_epoch=0 must be a positive integer, or -1 to repeat forever"),
  ("grain_worker_count=-1", "grain_worker_count=-1 must be >= 0"),
  ("eval_steps=-2", "eval_steps=-2 must be positive, or -1 for the whole eval split"),
  ("eval_per_device_batch_size=-1", "eval_per_device_batch_size=-1.0 must be >= 0 (0: per_device_batch_size)"),
  ("target_eval_loss=-1", "target_eval_loss=-1.0 must be >= 0 (0: no early stop)"),
  ("skip_first_n_steps_for_profiler=-1", "skip_first_n_steps_for_profiler=-1 must be >= 0"),
  ("decode_sampling_temperature=0", "decode_sampling_temperature=0.0 must be > 0"),
  ("compile_topology_num_slices=0", "compile_topology_num_slices=0 must be a positive number of slices (-1 means 1)"),
  ("dtype=float8", "dtype=float8 is not valid; choose one of: float32, bfloat16, float16"),
  ("profiler=tensorboard", 'profiler=tensorboard is not valid; choose one of: "" (none), xplane, nsys'),
  (
    "mlp_activations=[silu,swiglu]",
    "mlp_activations has unknown activation 'swiglu'; valid: silu, swish, gelu, gelu_exact, relu, tanh, sigmoid, linear",
  ),
]


@pytest.mark.parametrize("arg,message", MESSAGES)
def test_a_value_the_schema_refuses_gets_the_message_it_had(arg, message):
  with pytest.raises(ConfigError) as error:
    _validate(arg)
  assert str(error.value) == message


def test_special_values_of_a_range_are_accepted():
  _validate(
    "steps=-1",
    "learning_rate_schedule_steps=10",
    "num_epoch=-1",
    "eval_steps=-1",
    "ici_fsdp_parallelism=1",
    "ici_data_parallelism=-1",
  )
  _validate(max_num_checkpoints_to_keep=None, compile_topology_num_slices=-1, capacity_factor=-1.0)


def _assert_lists_every_key(text: str) -> None:
  for title in config_schema.SECTIONS:
    assert f"\n{title}:\n" in text
  missing = [name for name in DEFAULTS if f"\n  {name}: " not in text]
  assert not missing


def test_help_shows_type_default_range_switch_and_help():
  text = config_schema.format_help()
  _assert_lists_every_key(text)
  assert "  adam_b2: float = 0.95; in [0, 1)\n      Adam's second-moment decay.\n" in text
  assert "  stack_trace_to_cloud: bool = false; acts only with collect_stack_trace=true\n" in text
  assert '  profiler: str = ""; one of: "" (none), xplane, nsys\n' in text
  assert "  max_num_checkpoints_to_keep: int = null; null (keep all) or a positive integer\n" in text


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_train_py_help_lists_every_key_without_importing_jax(flag):
  result = run_python(["-X", "importtime", TRAIN_PY, flag])
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.startswith("Trains a decoder LM")
  _assert_lists_every_key(result.stdout)
  imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
  assert "MaxText.configuration.config_schema" in imported and "jax" not in imported


@pytest.mark.parametrize("argv", [["MaxText/decode.py", "--help"], ["MaxText/train_compile.py", BASE_YML, "-h"]])
def test_other_entry_points_print_the_keys_too(argv):
  result = run_python(argv)
  assert result.returncode == 0, result.stderr[-2000:]
  _assert_lists_every_key(result.stdout)


def test_initialize_prints_the_keys_and_exits_on_help(capsys):
  with pytest.raises(SystemExit) as exit_:
    pyconfig.initialize(["t", BASE_YML, "run_name=x", "--help"], environ={})
  assert exit_.value.code == 0
  assert capsys.readouterr().out == config_schema.format_help()
