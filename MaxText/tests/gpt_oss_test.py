"""GPT-OSS (decoder_block=gpt_oss) against transformers' GptOssForCausalLM: a tiny random model converted with
to_maxtext gives its logits, its step-0 loss and its greedy generation; the conversion round-trips bitwise; MXFP4
weights dequantize as transformers does."""

import json
import os
import shutil
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from MaxText.errors import UserError
from MaxText.hf_conversion import converter, gpt_oss, logit_check, mxfp4, peft
from MaxText.tests.helpers import lora_run, run_python, tiny_args
from MaxText.tests.hf_parity import assert_round_trip_is_bitwise, greedy_against_transformers, step0_losses
from MaxText.tests.tiny_models import HF_TINY, TINY_GPT_OSS, exports_give_our_logits, randomize_hf_weights

torch.set_num_threads(1)

WINDOW = 16  # logit_check's 64-token sequences cover 4 windows; layer 0 is a sliding one, layer 1 a full one
HF_GPT_OSS = dict(
  HF_TINY,
  num_local_experts=4,
  num_experts_per_tok=2,
  sliding_window=WINDOW,
  # YaRN as the released models' (not truncated): over head_dim 16 its ramp runs from dim 2.02 to 4.35, which
  # truncation would round to 2 and 5.
  rope_parameters={
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
  },
)
TOLERANCE = 1e-4


def _hf_model(directory: str) -> str:
  config = transformers.AutoConfig.for_model("gpt_oss", **HF_GPT_OSS)
  model = transformers.AutoModelForCausalLM.from_config(config)
  randomize_hf_weights(model, seed=11)
  gen = torch.Generator().manual_seed(12)
  with torch.no_grad():  # biases of order 0.1, not randomize_hf_weights' 1 of a norm: the output then varies by token
    for name, p in sorted(model.named_parameters()):
      if name.endswith("bias"):
        p.copy_(0.1 * torch.randn(p.shape, generator=gen))
  model.to(torch.float32).save_pretrained(directory)
  return directory


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """(hf_dir, maxtext_dir) of the tiny model, converted once."""
  root = tmp_path_factory.mktemp("gpt_oss")
  hf_dir = _hf_model(str(root / "hf"))
  converter.to_maxtext(hf_dir, str(root / "maxtext"))
  return hf_dir, str(root / "maxtext")


def _paths(maxtext_dir: str) -> tuple[str, str]:
  return os.path.join(maxtext_dir, converter.MODEL_YML), os.path.join(maxtext_dir, converter.PARAMS_DIR)


def test_logits_match_transformers_across_both_window_kinds(converted):
  hf_dir, maxtext_dir = converted
  tokens = logit_check.random_tokens(HF_TINY["vocab_size"])
  assert tokens.shape[1] > 2 * WINDOW
  max_abs, kl = logit_check.compare(
    logit_check.hf_logits(hf_dir, tokens), logit_check.maxtext_logits(*_paths(maxtext_dir), tokens)
  )
  print(f"\ngpt_oss logits vs transformers: max abs diff {max_abs:.2g}, KL {kl:.2g}")
  assert max_abs < TOLERANCE, f"max |logits diff| {max_abs:.3g} (KL {kl:.3g})"


def test_round_trip_is_bitwise(converted, tmp_path):
  hf_out = assert_round_trip_is_bitwise(*converted, str(tmp_path))
  with open(os.path.join(hf_out, "config.json"), encoding="utf-8") as f:
    written = transformers.GptOssConfig(**json.load(f))
  assert written.layer_types == transformers.GptOssConfig(**HF_GPT_OSS).layer_types
  assert written.rope_parameters["truncate"] is False and written.swiglu_limit == 7.0


def _packed(shape, seed: int):
  """Random MXFP4 blocks (..., G, 16) and scales (..., G) for a (..., G * 32) tensor, exponents around 2^0."""
  rng = np.random.default_rng(seed)
  *prefix, width = shape
  blocks = rng.integers(0, 256, (*prefix, width // 32, 16), dtype=np.uint8)
  scales = rng.integers(120, 130, (*prefix, width // 32), dtype=np.uint8)
  return blocks, scales


def test_mxfp4_dequantizes_as_transformers():
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # pylint: disable=import-outside-toplevel

  blocks, scales = _packed((3, 10, 64), seed=0)
  want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales)).float().numpy()
  got = mxfp4.dequantize(blocks, scales)
  assert got.shape == want.shape == (3, 64, 10)
  np.testing.assert_array_equal(got.astype(np.float32), want)


def test_mxfp4_release_checkpoint_converts_dequantized(converted, tmp_path):
  """The released layout (experts as *_blocks and *_scales, quantization_config mxfp4) converts to the experts that
  transformers dequantizes."""
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # pylint: disable=import-outside-toplevel

  hf_dir, _ = converted
  quantized = tmp_path / "hf"
  shutil.copytree(hf_dir, quantized)
  tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
  expected = {}
  for i, name in enumerate(n for n in sorted(tensors) if n.endswith(("gate_up_proj", "down_proj"))):
    experts, rows, cols = tensors.pop(name).shape  # (E, in, out), stored as (E, out, in / 32, 16)
    blocks, scales = _packed((experts, cols, rows), seed=i)
    tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    expected[name] = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales)).float().numpy()
  save_file(tensors, str(quantized / "model.safetensors"))
  with open(quantized / "config.json", encoding="utf-8") as f:
    hf_cfg = json.load(f)
  with open(quantized / "config.json", "w", encoding="utf-8") as f:
    json.dump(dict(hf_cfg, quantization_config={"quant_method": "mxfp4"}), f)
  converter.to_maxtext(str(quantized), str(tmp_path / "maxtext"))
  converter.to_hf(str(tmp_path / "maxtext"), str(tmp_path / "back"))
  back = load_file(str(tmp_path / "back" / "model.safetensors"))
  for name, value in expected.items():
    np.testing.assert_array_equal(back[name].astype(np.float32), value, err_msg=name)


def test_step0_training_loss_is_transformers_cross_entropy(converted):
  hf_dir, maxtext_dir = converted
  ours, expected = step0_losses(hf_dir, maxtext_dir, logit_check.random_tokens(HF_TINY["vocab_size"]))
  assert ours == pytest.approx(expected, rel=1e-4)


def test_greedy_decoding_with_the_cache_equals_transformers_generate(converted):
  """A 6-token prompt and 34 generated tokens: the cache runs past the sliding window (16) of layer 0."""
  prompt = [1, 5, 9, 200, 7, 31]
  ours, logits, theirs, hf_logits = greedy_against_transformers(
    *converted, prompt, max_target_length=40, max_prefill_predict_length=6
  )
  np.testing.assert_array_equal(ours, theirs)
  assert len(set(ours.tolist())) > 5  # a generation that varies, not one token repeated
  np.testing.assert_allclose(logits, hf_logits, atol=TOLERANCE, rtol=0)


@pytest.mark.slow
def test_lora_attention_adapters_export_to_peft_with_our_logits(tmp_path):
  """3 LoRA steps (train.py) on the attention's projections; PEFT 0.21's PeftModel on the HF base and the merged
  export give our logits (about 25 s)."""
  hf_dir = _hf_model(str(tmp_path / "hf"))
  lora = ["enable_lora=true", "lora_rank=4", "lora_alpha=8", "lora_module_path=^decoder/layers/self_attention/"]
  model_yml, base_params, run_dir, _ = lora_run(tmp_path, hf_dir, *lora, "per_device_batch_size=1", "max_target_length=16")
  tokens = logit_check.random_tokens(HF_TINY["vocab_size"], length=24)  # longer than the sliding window (16)
  exports_give_our_logits(tmp_path, run_dir, hf_dir, base_params, model_yml, tokens, label="gpt_oss ")


@pytest.mark.parametrize("module", ["MoeBlock_0/wi_0", "MoeBlock_0/gate"])
def test_an_expert_or_router_adapter_is_refused_in_one_line(tmp_path, module):
  """PEFT adapts nn.Linear modules; GPT-OSS's experts are fused 3-D parameters and its router's adapter is not
  PEFT's to hold: their export is one error line, before anything is written."""
  config = types.SimpleNamespace(decoder_block="gpt_oss", num_decoder_layers=2, param_scan_axis=1, lora_rank=4, lora_alpha=8)
  keys = ("decoder", "layers", *module.split("/"))
  with pytest.raises(UserError) as error:
    peft.write_peft(config, gpt_oss.FAMILY, {keys + ("lora_a",): None, keys + ("lora_b",): None}, str(tmp_path / "peft"))
  assert str(error.value) == (
    f"LoRA export: decoder/layers/{module} has no single HF nn.Linear in the gpt_oss table (PEFT cannot hold it)"
  )
  assert not (tmp_path / "peft").exists()


def _transformers_counts(layers: int, experts: int) -> tuple[int, int]:
  """(total, active) parameters of transformers' GptOssForCausalLM with the released dims, built on the meta device:
  active is the total less the experts a token does not run and the input embedding (a lookup)."""
  config = transformers.GptOssConfig(num_hidden_layers=layers, num_local_experts=experts)
  with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(config)
  total = sum(p.numel() for p in model.parameters())
  in_experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
  unused_experts = in_experts * (experts - config.num_experts_per_tok) // experts
  return total, total - unused_experts - config.vocab_size * config.hidden_size


@pytest.mark.parametrize(
  "preset, layers, experts, active", [("gpt-oss-20b", 24, 32, 3.6e9), ("gpt-oss-120b", 36, 128, 5.1e9)]
)
def test_preset_counts_equal_transformers(preset, layers, experts, active):
  """The preset's params (jax.eval_shape) number transformers' total; the FLOPs count's active weights (training's
  6 FLOPs per weight and token: attention, 4 experts, router, logits) its active ones, the model card's 3.6B and 5.1B
  (the norms, biases and sinks, 0.02%, are no matmul)."""
  from MaxText import pyconfig  # pylint: disable=import-outside-toplevel
  from MaxText.tests.helpers import (
    BASE_YML,  # pylint: disable=import-outside-toplevel
    param_count,  # pylint: disable=import-outside-toplevel
  )
  from MaxText.training import flops  # pylint: disable=import-outside-toplevel

  total, hf_active = _transformers_counts(layers, experts)
  assert param_count(preset) == pytest.approx(total, rel=1e-3)
  config = pyconfig.initialize(
    ["test", BASE_YML, "run_name=test", f"model_name={preset}", "per_device_batch_size=1", "max_target_length=2048"],
    environ={},
  )
  ours = flops.training_tflops_per_device(config).learnable_tflops * 1e12 / (6 * 2048)
  assert ours == pytest.approx(hf_active, rel=1e-3)
  assert ours == pytest.approx(active, rel=0.01)


# name -> parallelism of the 8-device layouts that train as the 1-device run: fsdp 2 x expert 4, the tokens going to
# their experts' devices (all_to_all: the experts' biases split over `expert` in the shard_map as their kernels), and
# the pipeline (its vmap over stage around the experts' shard_map). Context 4 x fsdp 2 and tensor 2 x fsdp 4 do too
# (run by hand).
LAYOUTS = {
  "fsdp_expert": ["ici_expert_parallelism=4", "ici_fsdp_parallelism=2", "moe_dispatch=all_to_all"],
  "pipeline": ["ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4"],
}


@pytest.mark.slow
def test_eight_device_layouts_train_as_one_device(tmp_path):
  """3 steps at learning_rate 1e-2 of the tiny GPT-OSS (every bias and the sinks trained): each 8-device layout's
  losses equal the 1-device run's (relative 1e-5). One child process runs them all (sharded_runs.py; about 30 s)."""

  def run(name, devices, *args):
    per_device = "per_device_batch_size=8" if devices == 1 else "per_device_batch_size=1"
    common = [f"base_output_directory={tmp_path}", f"run_name={name}", per_device, "steps=3", "learning_rate=1e-2"]
    common += ["enable_checkpointing=false", f"metrics_file={tmp_path / name}.jsonl", "attention=dot_product"]
    return {"name": name, "devices": devices, "args": tiny_args(*common, *TINY_GPT_OSS, *args), "decode": False}

  runs_path, report_path = tmp_path / "runs.json", tmp_path / "report.json"
  runs_path.write_text(json.dumps([run("one", 1), *(run(name, 8, *args) for name, args in LAYOUTS.items())]))
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0", "JAX_PLATFORMS": "cpu"}
  result = run_python(["-m", "MaxText.tests.sharded_runs", str(runs_path), str(report_path)], env_extra=env)
  assert result.returncode == 0, result.stderr[-5000:]
  report = json.loads(report_path.read_text())
  one = report["one"]["metrics"]
  assert one["learning/loss"][-1] < one["learning/loss"][0]
  for name in LAYOUTS:
    for key in ("learning/loss", "learning/moe_lb_loss"):
      np.testing.assert_allclose(report[name]["metrics"][key], one[key], rtol=1e-5, err_msg=f"{name} {key}")
  print({name: report[name]["metrics"]["learning/loss"] for name in ("one", *LAYOUTS)})


def test_flash_carries_the_sinks_as_dot_product_does():
  """The splash kernel (Pallas interpreter) with sinks and a sliding window gives dot_product's output (the forward:
  the interpreted backward takes 10 s more; gpt-oss-20b's AOT compile for v5p-8 builds the real one)."""
  from MaxText.layers.attentions import dot_product_attention  # pylint: disable=import-outside-toplevel
  from MaxText.layers.flash_attention import flash_attention  # pylint: disable=import-outside-toplevel

  ks = jax.random.split(jax.random.PRNGKey(0), 4)
  q, k, v = (jax.random.normal(key, (1, 128, n, 64)) / s for key, n, s in zip(ks, (4, 2, 2), (8, 1, 1)))
  sinks, seg = jax.random.normal(ks[3], (4,)), jnp.ones((1, 128), jnp.int32)
  flash = flash_attention(q, k, v, seg, sliding_window=40, interpret=True, sinks=sinks)
  dot = dot_product_attention(q, k, v, seg, sliding_window=40, sinks=sinks)
  np.testing.assert_allclose(flash, dot, atol=2e-6)
  assert np.max(np.abs(dot - dot_product_attention(q, k, v, seg, sliding_window=40))) > 1e-2  # the sinks matter


def test_routed_bias_is_trained_for_gpt_oss_and_moved_for_deepseek():
  """routed_bias=true: GPT-OSS's router bias is an ordinary trained param (no routing_bias feature holds it out of the
  optimizer), DeepSeek's the selection bias that the feature moves towards equal loads."""
  from MaxText.features import selection  # pylint: disable=import-outside-toplevel
  from MaxText.tests.helpers import tiny_config  # pylint: disable=import-outside-toplevel
  from MaxText.tests.tiny_models import DEEPSEEK  # pylint: disable=import-outside-toplevel

  def features(*args):
    return [feature.name for feature in selection.for_config(tiny_config(*args, "routed_bias=true"))]

  assert "routing_bias" not in features(*TINY_GPT_OSS)
  assert "routing_bias" in features(*DEEPSEEK)


def test_yarn_frequencies_and_attention_factor_match_transformers():
  """The released models' YaRN (head_dim 64, factor 32 over 4096 positions, not truncated): standard attention's
  frequencies and cos/sin factor are transformers' (its ramp from dim 8.09 to 17.40; truncated would be 8 to 18)."""
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # pylint: disable=import-outside-toplevel

  from MaxText.layers import embeddings  # pylint: disable=import-outside-toplevel
  from MaxText.layers.yarn import YarnRopeScaling  # pylint: disable=import-outside-toplevel

  inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](transformers.GptOssConfig())
  for truncate, same in ((False, True), (True, False)):
    scaling = YarnRopeScaling(32.0, 4096, 32.0, 1.0, truncate=truncate)
    ours = embeddings.rope_inverse_frequencies(64, 1, 150000, scaling)
    assert np.allclose(ours, inv_freq.numpy(), rtol=1e-6, atol=0) == same
  assert scaling.attention_factor == pytest.approx(attention_factor, rel=1e-12)


def test_balance_loss_is_transformers_aux_loss(converted):
  """The routers' load-balancing loss (what load_balance_loss_weight weighs; config.json's router_aux_loss_coef) is
  transformers' aux_loss on the same tokens."""
  from MaxText.layers import moe  # pylint: disable=import-outside-toplevel

  hf_dir, maxtext_dir = converted
  tokens = logit_check.random_tokens(HF_TINY["vocab_size"])
  reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
  with torch.no_grad():
    expected = float(reference(torch.from_numpy(np.asarray(tokens)).long(), output_router_logits=True).aux_loss)
  config, model, params = logit_check.converted_model(*_paths(maxtext_dir), tokens.shape[1])
  positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
  with jax.default_matmul_precision("float32"):
    _, state = model.apply({"params": params}, tokens, positions, mutable=["intermediates"])
  ours = float(moe.load_balancing_loss(state["intermediates"], config.num_experts))
  assert ours == pytest.approx(expected, rel=1e-5)
  assert config.load_balance_loss_weight == reference.config.router_aux_loss_coef
