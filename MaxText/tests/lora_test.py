"""LoRA: the config keys (flat or upstream's nested `lora:`), only the adapters in the optimizer, the base frozen,
a lora_module_path that selects nothing, and a short run whose loss falls."""

import json

import numpy as np
import pytest

from MaxText.configuration import config_loader
from MaxText.errors import ConfigError
from MaxText.tests.helpers import (
  BASE_YML,
  CHATML,
  LORA_MODULES,
  build_chat_tokenizer,
  chat_sft_losses,
  lora_run,
  run_train,
  tiny_config,
)
from MaxText.tests.tiny_models import exports_give_our_logits, hf_llama, nonzero_lora_b


def _setup(*args):
  from MaxText.runtime.mesh import create_device_mesh  # pylint: disable=import-outside-toplevel
  from MaxText.training import training_setup  # pylint: disable=import-outside-toplevel

  config = tiny_config("enable_lora=true", *args)
  return config, training_setup.build(config, create_device_mesh(config))


def _paths(tree) -> list[str]:
  from MaxText.layers import layer_names  # pylint: disable=import-outside-toplevel

  return ["/".join(keys) for keys, _ in layer_names.flatten(tree)]


def test_nested_lora_mapping_in_yaml_and_dotted_keys_on_the_command_line(tmp_path):
  path = tmp_path / "lora.yml"
  path.write_text(f"base_config: {BASE_YML}\nlora:\n  enable_lora: true\n  lora_rank: 16\n", encoding="utf-8")
  values, _ = config_loader.load_raw_config(["t", str(path), "lora.lora_alpha=32"], {})
  assert (values["enable_lora"], values["lora_rank"], values["lora_alpha"]) == (True, 16, 32.0)


def test_only_the_adapters_are_in_the_optimizer_state():
  _, setup = _setup("lora_module_path=decoder/layers/(self_attention/(query|value)|mlp/wo)")
  params = _paths(setup.abstract_state.params)
  adapters = [p for p in params if p.endswith(("/lora_a", "/lora_b"))]
  assert len(adapters) == 6, params  # query, value, wo: A and B each
  moments = [p for p in _paths(setup.abstract_state.opt_state) if not p.endswith("count")]
  assert len(moments) == 2 * len(adapters)  # Adam's mu and nu, of the adapters only
  assert all(p.endswith(("/lora_a", "/lora_b")) for p in moments), moments


def test_adapters_are_sharded_like_the_kernel_they_adapt():
  _, setup = _setup("lora_module_path=decoder.layers.self_attention.query")
  query = setup.abstract_state.params["decoder"]["layers"]["self_attention"]["query"]
  kernel, a, b = (query[k].sharding.spec for k in ("kernel", "lora_a", "lora_b"))
  assert (a[0], b[-2]) == (kernel[0], kernel[-2])  # A: the input dim's axes; B: the heads'


def test_a_module_path_that_selects_nothing_is_one_line():
  with pytest.raises(ConfigError, match=r"lora_module_path='decoder/nothing' selects no dense layer; .*mlp/wo"):
    _setup("lora_module_path=decoder/nothing")


def test_a_step_moves_the_adapters_only():
  import jax  # pylint: disable=import-outside-toplevel

  from MaxText.runtime.mesh import create_device_mesh  # pylint: disable=import-outside-toplevel
  from MaxText.tests.helpers import token_batch  # pylint: disable=import-outside-toplevel
  from MaxText.training import train_step  # pylint: disable=import-outside-toplevel

  config, setup = _setup("learning_rate=1e-2", "warmup_steps_fraction=0")
  mesh = create_device_mesh(config)
  state = setup.init_state(config, mesh)
  state = state.replace(params=nonzero_lora_b(state.params))  # a trained-looking B, so that A gets a gradient too
  new_state, _ = jax.jit(lambda s, b: train_step.train_step(setup.model, config, setup.features, s, b))(state, token_batch())
  for path, old, new in zip(_paths(state.params), jax.tree.leaves(state.params), jax.tree.leaves(new_state.params)):
    moved = not np.array_equal(np.asarray(old), np.asarray(new))
    assert moved == path.endswith(("/lora_a", "/lora_b")), path


@pytest.mark.slow
def test_lora_sft_run_loss_falls(tmp_path):
  """30 steps of LoRA SFT on a small repeated chat set (helpers.CONVERSATIONS): the completion-only loss falls."""
  lora = ["enable_lora=true", "lora_rank=16", "lora_module_path=decoder/layers/.*", "learning_rate=3e-2"]
  losses = chat_sft_losses(tmp_path, "lora", build_chat_tokenizer(tmp_path / "tok", CHATML), *lora)
  assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses


def test_lora_round_trip_peft_and_merged_export_give_our_logits(tmp_path, capsys):
  """A converted tiny HF llama, 3 LoRA steps (attention and MLP), resumed for a 4th; the PEFT export on the HF base
  and the merged export both give our LoRA model's logits."""

  from MaxText.hf_conversion import converter, logit_check  # pylint: disable=import-outside-toplevel

  hf_dir = hf_llama(tmp_path / "hf")
  nested = ["lora.enable_lora=true", "lora.lora_rank=4", "lora.lora_alpha=8", f"lora.lora_module_path={LORA_MODULES}"]
  # The second run resumes from the first one's adapters-only checkpoint.
  model_yml, base_params, run_dir, result = lora_run(tmp_path, hf_dir, *nested, stops=(3, 4))
  saved = [k for k in maxtext_io_keys(converter.load_maxtext_dir(run_dir)[1]) if k[0] == "params"]
  assert saved and all(k[-1] in ("lora_a", "lora_b") for k in saved), saved  # the base is not in the checkpoint
  assert "Restored the checkpoint of step" in result.stdout, result.stdout[-3000:]

  tokens = logit_check.random_tokens(320, length=24)
  ours = exports_give_our_logits(tmp_path, run_dir, hf_dir, base_params, model_yml, tokens)
  with open(tmp_path / "peft" / "adapter_config.json", encoding="utf-8") as f:
    assert json.load(f)["base_model_name_or_path"] == hf_dir  # the HF source of the run's load_parameters_path

  # decode.py's params: the run's adapters (its latest checkpoint) joined onto load_parameters_path's base.
  np.testing.assert_allclose(_decoding_logits(tmp_path, base_params, model_yml, tokens), ours, atol=1e-5)
  # Without enable_lora decode would leave the run's adapters out: it says so.
  from MaxText.inference import decoding  # pylint: disable=import-outside-toplevel

  run_keys = dict(run_name="lora", base_output_directory=str(tmp_path), load_parameters_path=base_params)
  decoding._warn_if_the_run_has_adapters(converter.maxtext_config(model_yml, **run_keys))  # pylint: disable=protected-access
  assert "run lora's latest checkpoint holds LoRA adapters, which this decode leaves out" in capsys.readouterr().err


def _decoding_logits(tmp_path, base_params: str, model_yml: str, tokens: np.ndarray) -> np.ndarray:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from MaxText.hf_conversion import converter  # pylint: disable=import-outside-toplevel
  from MaxText.inference import decoding  # pylint: disable=import-outside-toplevel
  from MaxText.runtime import mesh  # pylint: disable=import-outside-toplevel

  run_keys = dict(run_name="lora", base_output_directory=str(tmp_path), load_parameters_path=base_params)
  lora_keys = dict(enable_lora=True, lora_rank=4, lora_alpha=8.0, lora_module_path=LORA_MODULES)
  config = converter.maxtext_config(
    model_yml, dtype="float32", weight_dtype="float32", max_target_length=tokens.shape[1], **run_keys, **lora_keys
  )
  device_mesh = mesh.create_device_mesh(config)
  model, abstract = decoding.build(config, device_mesh)
  params = decoding.load_params(config, model, abstract, device_mesh)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  with jax.default_matmul_precision("float32"):
    return np.asarray(model.apply({"params": params}, tokens, positions))


def maxtext_io_keys(items: str) -> list[tuple]:
  from MaxText.hf_conversion import maxtext_io  # pylint: disable=import-outside-toplevel

  return maxtext_io.ParamsReader(items).keys


def _peft_adapter(hf_dir: str, out_dir: str) -> str:
  """A PEFT LoRA adapter (r 4, q_proj, o_proj and down_proj) with random A and B, saved as PEFT saves one."""
  import peft  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  torch.manual_seed(1)
  base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
  lora_config = peft.LoraConfig(
    r=4, lora_alpha=12, target_modules=["q_proj", "o_proj", "down_proj"], init_lora_weights=False
  )
  peft.get_peft_model(base, lora_config).save_pretrained(out_dir)
  return out_dir


def test_to_maxtext_reads_a_peft_adapter_and_gives_its_logits(tmp_path):
  import peft  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  from MaxText import convert_checkpoint  # pylint: disable=import-outside-toplevel
  from MaxText.hf_conversion import converter, logit_check  # pylint: disable=import-outside-toplevel

  hf_dir = hf_llama(tmp_path / "hf")
  adapter = _peft_adapter(hf_dir, str(tmp_path / "adapter"))
  out = tmp_path / "maxtext"
  convert_checkpoint.main(["c", "to_maxtext", "--hf_path", hf_dir, "--peft_adapter", adapter, "--output_dir", str(out)])
  tokens = logit_check.random_tokens(320, length=24)
  model_yml = str(out / converter.MODEL_YML)
  ours = _lora_logits_of_params(model_yml, str(out / "params"), tokens)
  base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
  with torch.no_grad():
    expected = peft.PeftModel.from_pretrained(base, adapter).eval()(torch.from_numpy(tokens.astype(np.int64))).logits
  diff = np.max(np.abs(expected.numpy() - ours))
  print(f"\nPEFT adapter read in: ours vs PeftModel {diff:.2e}")
  assert diff < 1e-4

  # A run started from those params starts from the adapter, not from fresh adapters.
  import jax  # pylint: disable=import-outside-toplevel

  from MaxText import pyconfig  # pylint: disable=import-outside-toplevel
  from MaxText.runtime.mesh import create_device_mesh  # pylint: disable=import-outside-toplevel
  from MaxText.training import starting_state, training_setup

  config = pyconfig.initialize(["t", model_yml, "run_name=t", f"load_parameters_path={out / 'params'}"], environ={})
  mesh = create_device_mesh(config)
  setup = training_setup.build(config, mesh)
  init = lambda: setup.init_state(config, mesh)
  state, _ = starting_state.initial_state(config, setup.features, None, setup.abstract_state, init)
  wo = state.params["decoder"]["layers"]["mlp"]["wo"]
  expected_b = peft_file(adapter)["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].T
  np.testing.assert_array_equal(np.take(np.asarray(jax.device_get(wo["lora_b"])), 1, config.param_scan_axis), expected_b)


def test_a_peft_adapter_of_another_base_is_one_line(tmp_path):
  from MaxText.errors import UserError  # pylint: disable=import-outside-toplevel
  from MaxText.hf_conversion import converter  # pylint: disable=import-outside-toplevel

  other = hf_llama(tmp_path / "other", hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
  adapter = _peft_adapter(other, str(tmp_path / "adapter"))
  hf_dir = hf_llama(tmp_path / "hf")
  with pytest.raises(UserError, match=r"q_proj has lora_A \[4, 32\] .* needs \[4, 64\] .*another base model"):
    converter.to_maxtext(hf_dir, str(tmp_path / "maxtext"), adapter)


def _lora_logits_of_params(model_yml: str, params_dir: str, tokens: np.ndarray) -> np.ndarray:
  """Our LoRA model's float32 logits with the LoRA config of model_yml and params_dir's base and adapters."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from MaxText.checkpoints import checkpointing  # pylint: disable=import-outside-toplevel
  from MaxText.hf_conversion import converter  # pylint: disable=import-outside-toplevel
  from MaxText.training import training_setup  # pylint: disable=import-outside-toplevel

  config = converter.maxtext_config(model_yml, dtype="float32", weight_dtype="float32", max_target_length=tokens.shape[1])
  model = training_setup.create_model(config)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  abstract = jax.eval_shape(lambda: model.init({"params": jax.random.PRNGKey(0)}, tokens, positions))["params"]
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), nn.unbox(abstract))
  params = checkpointing.load_params(params_dir, abstract, config.param_scan_axis)
  with jax.default_matmul_precision("float32"):
    return np.asarray(model.apply({"params": params}, tokens, positions))


def peft_file(adapter_dir: str) -> dict:
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel

  return load_file(f"{adapter_dir}/adapter_model.safetensors")


@pytest.mark.slow  # llama2-7b compiled for v5e-8 on the CPU: a minute or more
def test_llama2_7b_lora_fits_v5e_8_with_room():
  """The frozen base's gradients stay sharded: zero updates that did not read them left them whole on every device
  (25.5 GiB of temporaries; full fine-tuning needs 15.74 GiB in all, LoRA rank 16 8.79 GiB)."""
  from MaxText import pyconfig  # pylint: disable=import-outside-toplevel
  from MaxText.aot import aot_compile

  args = ["model_name=llama2-7b", "compile_topology=v5e-8", "per_device_batch_size=1", "dataset_type=synthetic"]
  config = pyconfig.initialize(
    ["t", BASE_YML, *args, "enable_lora=true", "lora_rank=16"], environ={}, for_compile_topology=True
  )
  outcome = aot_compile.compile_for_target(config)
  assert outcome.fits, outcome.compiler_error
  assert outcome.memory.peak_bytes < 10 * 2**30


@pytest.mark.parametrize("qtype", ["", "int8", "nf4"])
def test_the_logged_size_is_the_model_and_its_adapters_whatever_the_base_is_held_in(qtype):
  """QLoRA's codes count as the weights they hold (nf4: two a byte) and their scales not at all."""
  import jax  # pylint: disable=import-outside-toplevel

  from MaxText import feature_protocol  # pylint: disable=import-outside-toplevel
  from MaxText.runtime.mesh import create_device_mesh  # pylint: disable=import-outside-toplevel
  from MaxText.training import training_setup  # pylint: disable=import-outside-toplevel

  plain = tiny_config()
  model = sum(x.size for x in jax.tree.leaves(training_setup.build(plain, create_device_mesh(plain)).abstract_state.params))
  _, setup = _setup("lora_module_path=decoder/layers/self_attention/query", "lora_rank=4", f"lora_weight_qtype={qtype}")
  adapters = plain.base_num_decoder_layers * (plain.base_emb_dim * 4 + 4 * plain.base_num_query_heads * plain.head_dim)
  params = setup.abstract_state.params
  assert feature_protocol.parameter_count(setup.features, params) == model + adapters
  share = f"{adapters:,} trainable LoRA adapters ({100 * adapters / (model + adapters):.3f}%)"
  assert feature_protocol.describe_parameters(setup.features, params).endswith(share)


@pytest.mark.slow  # three train.py runs: about 16 s of the unit suite
def test_load_full_state_path_of_a_lora_run_continues_it_on_its_base(tmp_path):
  """load_full_state_path of a LoRA run (adapters, their optimizer state, step) onto the same base continues it: with
  every batch the same, the next step's loss is the run's own. A run without LoRA given it is told so in one line."""
  data = tmp_path / "same.jsonl"
  data.write_text("".join(json.dumps({"text": "the cat sat on the mat " * 8}) + "\n" for _ in range(64)), encoding="utf-8")
  common = ["dataset_type=hf", "hf_path=json", f"hf_train_files={data}", "enable_data_shuffling=false", "packing=false"]
  lora = ["enable_lora=true", "lora_rank=4"]
  result, whole = run_train(tmp_path, "whole", "steps=5", "checkpoint_period=3", *lora, *common)
  assert result.returncode == 0, result.stderr[-3000:]
  items = tmp_path / "whole" / "checkpoints" / "3" / "items"
  result, continued = run_train(tmp_path, "continued", "steps=5", f"load_full_state_path={items}", *lora, *common)
  assert result.returncode == 0, result.stderr[-3000:]
  assert [m["step"] for m in continued] == [4]
  assert continued[0]["learning/loss"] == whole[4]["learning/loss"]
  result, _ = run_train(tmp_path, "plain", "steps=5", f"load_full_state_path={items}", *common)
  assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].endswith(
    "holds a LoRA run's adapters and their optimizer state: set enable_lora=true (and its lora_* keys), with the base "
    "model as load_parameters_path"
  ), result.stderr[-2000:]
