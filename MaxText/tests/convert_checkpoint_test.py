"""Hugging Face <-> MaxText conversion against transformers: tiny random models of each family
(tiny_models.build_hf_model).

Each family converts to MaxText with logits within 1e-4 (float32) of transformers; both round trips are
bitwise; the HF directory that to_hf writes loads with from_pretrained and gives the same logits.
"""

import json
import os

import numpy as np
import pytest
import torch  # requirements-test.txt
import transformers

from MaxText.checkpoints import checkpointing
from MaxText.hf_conversion import converter, logit_check
from MaxText.tests.helpers import run_python
from MaxText.tests.hf_parity import assert_round_trip_is_bitwise, maxtext_params, step0_losses
from MaxText.tests.tiny_models import HF_FAMILIES, HF_LLAMA31_ROPE, HF_TINY, build_hf_model, hf_tensors, randomize_hf_weights

TOLERANCE = 1e-4  # float32, as the issue fixes it; never loosened to make a test pass
PARITY = {}  # family -> (max_abs_diff, kl), printed at the end of the module


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """family -> (hf_dir, maxtext_dir), built and converted once per module."""
  cache = {}

  def get(family: str):
    if family not in cache:
      root = tmp_path_factory.mktemp(family)
      hf_dir = build_hf_model(str(root / "hf"), family)
      converter.to_maxtext(hf_dir, str(root / "maxtext"))
      cache[family] = (hf_dir, str(root / "maxtext"))
    return cache[family]

  yield get
  if PARITY:
    print("\nfamily            max_abs_diff   kl")
    for family, (max_abs, kl) in PARITY.items():
      print(f"{family:<17} {max_abs:<14.3g} {kl:.3g}")


def _logits(maxtext_dir: str, tokens, **kwargs):
  model_yml = os.path.join(maxtext_dir, converter.MODEL_YML)
  return logit_check.maxtext_logits(model_yml, os.path.join(maxtext_dir, converter.PARAMS_DIR), tokens, **kwargs)


@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_logits_match_transformers(converted, family):
  hf_dir, maxtext_dir = converted(family)
  tokens = logit_check.random_tokens(HF_TINY["vocab_size"])
  max_abs, kl = logit_check.compare(logit_check.hf_logits(hf_dir, tokens), _logits(maxtext_dir, tokens))
  PARITY[family] = (max_abs, kl)
  assert max_abs < TOLERANCE, f"{family}: max |logits diff| {max_abs:.3g} (KL {kl:.3g})"


@pytest.mark.parametrize("family", ["gemma3", "deepseek", "qwen3_moe"])
def test_step0_training_loss_is_transformers_cross_entropy(converted, family):
  """train_step's loss (without auxiliary terms) on the converted params equals transformers' loss with labels."""
  hf_dir, maxtext_dir = converted(family)
  ours, expected = step0_losses(hf_dir, maxtext_dir, logit_check.random_tokens(HF_TINY["vocab_size"]))
  assert ours == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_round_trips_are_bitwise(converted, family, tmp_path):
  hf_dir, maxtext_dir = converted(family)
  hf_out = assert_round_trip_is_bitwise(hf_dir, maxtext_dir, str(tmp_path))

  tokens = logit_check.random_tokens(HF_TINY["vocab_size"])
  np.testing.assert_array_equal(logit_check.hf_logits(hf_out, tokens), logit_check.hf_logits(hf_dir, tokens))


def test_hidden_states_match_layer_by_layer(converted):
  """Each decoder layer's output (unscanned layers_i) against transformers' hidden states, so a mismatch names its layer."""
  hf_dir, maxtext_dir = converted("llama")
  tokens = logit_check.random_tokens(HF_TINY["vocab_size"])
  _, hidden = logit_check.hf_logits(hf_dir, tokens, hidden_states=True)
  _, intermediates = _logits(maxtext_dir, tokens, scan_layers=False, intermediates=True)
  decoder = intermediates["decoder"]
  # hidden[0] is the embedding, hidden[i + 1] the output of layer i (the last one after the final norm).
  for i in range(HF_TINY["num_hidden_layers"] - 1):
    ours = np.asarray(decoder[f"layers_{i}"]["__call__"][0])
    diff = float(np.max(np.abs(ours - hidden[i + 1])))
    assert diff < TOLERANCE, f"decoder layer {i}: max |hidden state diff| {diff:.3g}"


def test_bfloat16_sharded_and_bin_checkpoints_convert_alike(tmp_path):
  """bfloat16 weights stay bfloat16 (bitwise back to HF); sharded safetensors and torch .bin shards read the same."""
  single = build_hf_model(str(tmp_path / "single"), "llama", dtype=torch.bfloat16)
  sharded = build_hf_model(str(tmp_path / "sharded"), "llama", dtype=torch.bfloat16, max_shard_size="100KB")
  assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
  bin_dir = str(tmp_path / "bin")
  os.makedirs(bin_dir)
  torch.save(hf_tensors(single), os.path.join(bin_dir, "pytorch_model.bin"))
  with open(os.path.join(single, "config.json"), encoding="utf-8") as f:
    config = json.load(f)
  with open(os.path.join(bin_dir, "config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f)
  outs = {name: str(tmp_path / f"out_{name}") for name in ("single", "sharded", "bin")}
  for name, source in (("single", single), ("sharded", sharded), ("bin", bin_dir)):
    converter.to_maxtext(source, outs[name])
  reference = maxtext_params(outs["single"])
  assert {v.dtype.name for v in reference.values()} == {"bfloat16"}
  for name in ("sharded", "bin"):
    other = maxtext_params(outs[name])
    assert all(np.array_equal(reference[k], other[k]) for k in reference), name
  hf_out = converter.to_hf(outs["single"], str(tmp_path / "hf_out"))
  original, back = hf_tensors(single), hf_tensors(hf_out)
  assert all(torch.equal(original[k], back[k]) and back[k].dtype == torch.bfloat16 for k in original)


def _abstract(maxtext_dir: str, scan_layers: bool) -> dict:
  import jax  # pylint: disable=import-outside-toplevel

  config = converter.maxtext_config(os.path.join(maxtext_dir, converter.MODEL_YML), scan_layers=scan_layers)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = {}
  for keys, shape in converter.abstract_param_shapes(config).items():
    node = abstract
    for k in keys[:-1]:
      node = node.setdefault(k, {})
    node[keys[-1]] = jax.ShapeDtypeStruct(shape, np.float32, sharding=device)
  return abstract


def test_checkpoint_loads_in_either_layout(converted, tmp_path):
  """load_parameters_path reads scanned params into an unscanned run and per-layer params into a scanned one."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  _, maxtext_dir = converted("llama")
  scanned_dir = os.path.join(maxtext_dir, converter.PARAMS_DIR)
  per_layer = checkpointing.load_params(scanned_dir, _abstract(maxtext_dir, scan_layers=False))
  assert "layers_1" in per_layer["decoder"] and "layers" not in per_layer["decoder"]
  # A per-layer checkpoint, as generate_param_only_checkpoint force_unroll=true writes it (Orbax, OCDBT).
  per_layer_dir = str(tmp_path / "per_layer")
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(per_layer_dir, {"params": per_layer})
  checkpointer.wait_until_finished()
  restacked = checkpointing.load_params(per_layer_dir, _abstract(maxtext_dir, scan_layers=True))
  original = maxtext_params(maxtext_dir)
  flat = {tuple(str(k.key) for k in path): np.asarray(v) for path, v in _flatten(restacked)}
  assert sorted(flat) == sorted(original)
  for keys, value in original.items():
    np.testing.assert_array_equal(flat[keys], value, err_msg=str(keys))
  tokens = logit_check.random_tokens(HF_TINY["vocab_size"])
  np.testing.assert_allclose(
    _logits(maxtext_dir, tokens, scan_layers=False), _logits(maxtext_dir, tokens, scan_layers=True), rtol=0, atol=1e-5
  )


def _flatten(tree):
  import jax  # pylint: disable=import-outside-toplevel

  return jax.tree_util.tree_flatten_with_path(tree)[0]


def _cli(*args):
  return run_python(["MaxText/convert_checkpoint.py", *args], timeout=300)


def test_errors_name_the_problem_in_one_line(converted, tmp_path):
  hf_dir, _ = converted("llama")
  # Unsupported architecture.
  bert = tmp_path / "bert"
  bert.mkdir()
  (bert / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
  result = _cli("to_maxtext", "--hf_path", str(bert), "--output_dir", str(tmp_path / "o1"))
  assert result.returncode == 2, result.stderr
  lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
  assert len(lines) == 1 and "unsupported architecture BertForMaskedLM" in lines[0], result.stderr
  # Missing config.json.
  with pytest.raises(checkpointing.UserError, match="config.json is missing"):
    converter.to_maxtext(str(tmp_path), str(tmp_path / "o2"))
  # A missing tensor, and a tensor of the wrong shape.
  broken = tmp_path / "broken"
  broken.mkdir()
  tensors = {k: v.clone() for k, v in hf_tensors(hf_dir).items()}
  del tensors["model.layers.1.mlp.up_proj.weight"]
  from safetensors.torch import save_file  # pylint: disable=import-outside-toplevel

  save_file(tensors, str(broken / "model.safetensors"))
  (broken / "config.json").write_text(open(os.path.join(hf_dir, "config.json"), encoding="utf-8").read())
  with pytest.raises(checkpointing.UserError, match=r"has no tensor model\.layers\.1\.mlp\.up_proj\.weight"):
    converter.to_maxtext(str(broken), str(tmp_path / "o3"))
  tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(95, 64)
  save_file(tensors, str(broken / "model.safetensors"))
  with pytest.raises(
    checkpointing.UserError, match=r"up_proj\.weight .* has shape \[95, 64\]; config.json implies \[96, 64\]"
  ):
    converter.to_maxtext(str(broken), str(tmp_path / "o4"))
  # No overwriting.
  _, maxtext_dir = converted("llama")
  with pytest.raises(checkpointing.UserError, match="already exists and is not empty"):
    converter.to_maxtext(hf_dir, maxtext_dir)


def test_config_json_old_and_new_rope_forms():
  """transformers 5's rope_parameters and the older rope_theta + rope_scaling give the same MaxText keys."""
  from MaxText.hf_conversion import llama  # pylint: disable=import-outside-toplevel

  base = {"model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5, **HF_TINY}
  new = dict(base, rope_parameters=HF_LLAMA31_ROPE)
  old_scaling = {k: v for k, v in HF_LLAMA31_ROPE.items() if k != "rope_theta"}
  old = dict(base, rope_theta=HF_LLAMA31_ROPE["rope_theta"], rope_scaling=old_scaling)
  keys = llama.config_to_maxtext(new, "new/config.json")
  assert keys == llama.config_to_maxtext(old, "old/config.json")
  assert keys["rope_max_timescale"] == 500000 and keys["rope_scaling_factor"] == 8
  unsupported = dict(base, rope_scaling={"rope_type": "yarn", "factor": 4.0})
  with pytest.raises(checkpointing.UserError, match="rope type 'yarn' is not supported"):
    llama.config_to_maxtext(unsupported, "yarn/config.json")


def test_gemma3_config_forms_of_the_hub_and_transformers_5():
  """The Hub's 1b config.json (rope_theta, rope_local_base_freq, sliding_window_pattern, no layer_types), its 4b one
  (a multimodal config whose sparse text_config leans on transformers' defaults) and transformers 5's
  rope_parameters per layer type."""
  from MaxText.hf_conversion import gemma3  # pylint: disable=import-outside-toplevel

  hub_1b = {
    "model_type": "gemma3_text",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "vocab_size": 262144,
    "query_pre_attn_scalar": 256,
    "rope_theta": 1000000,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "hidden_activation": "gelu_pytorch_tanh",
  }
  keys = gemma3.config_to_maxtext(hub_1b, "1b/config.json")
  assert (keys["rope_max_timescale"], keys["local_rope_max_timescale"], keys["rope_linear_scaling_factor"]) == (
    1000000,
    10000,
    1.0,
  )
  assert (keys["base_num_decoder_layers"], keys["sliding_window_size"], keys["vocab_size"]) == (26, 512, 262144)
  text = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34}
  text.update(rope_scaling={"factor": 8.0, "rope_type": "linear"}, sliding_window=1024)
  hub_4b = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": text}
  keys = gemma3.config_to_maxtext(hub_4b, "4b/config.json")
  assert (keys["base_num_query_heads"], keys["base_num_kv_heads"], keys["head_dim"], keys["vocab_size"]) == (
    8,
    4,
    256,
    262208,
  )
  assert (keys["rope_linear_scaling_factor"], keys["rope_max_timescale"], keys["local_rope_max_timescale"]) == (
    8.0,
    1000000,
    10000,
  )
  v5 = transformers.Gemma3TextConfig(**{k: v for k, v in text.items() if k != "model_type"}).to_dict()
  assert gemma3.config_to_maxtext(v5, "v5/config.json") == keys
  shifted = dict(hub_1b, layer_types=["full_attention"] + ["sliding_attention"] * 25)
  with pytest.raises(checkpointing.UserError, match="a global \\(full attention\\) layer after every 5 local"):
    gemma3.config_to_maxtext(shifted, "shifted/config.json")


def test_deepseek_config_as_the_hub_ships_it():
  """deepseek-ai/DeepSeek-V3's config.json: rope_scaling with "type": "yarn", no head_dim, num_nextn_predict_layers."""
  from MaxText.hf_conversion import deepseek  # pylint: disable=import-outside-toplevel

  hub = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "rope_scaling": {
      "beta_fast": 32,
      "beta_slow": 1,
      "factor": 40,
      "mscale": 1.0,
      "mscale_all_dim": 1.0,
      "original_max_position_embeddings": 4096,
      "type": "yarn",
    },
    "tie_word_embeddings": False,
    "vocab_size": 129280,
    "num_nextn_predict_layers": 1,
  }
  keys = deepseek.config_to_maxtext(hub, "hub/config.json")
  preset = converter.maxtext_config(os.path.join("MaxText", "configs", "models", "deepseek3-671b.yml"))
  for key, value in keys.items():
    if key not in ("mtp_num_layers", "normalize_embedding_logits"):  # the latter only matters with tied logits
      assert value == (list(getattr(preset, key)) if isinstance(value, list) else getattr(preset, key)), key
  assert keys["mtp_num_layers"] == 1 and keys["rope_type"] == "yarn" and keys["rope_factor"] == 40.0


def test_deepseek_fp8_block_scaled_weights_read_as_bfloat16(tmp_path):
  """DeepSeek-V3 ships FP8 (e4m3) projections with weight_scale_inv per 128 x 128 block (16 x 16 here): they convert
  to bfloat16 w * scale_inv, as DeepSeek's fp8_cast_bf16.py does; the logits match transformers on those weights."""
  from safetensors.torch import save_file  # pylint: disable=import-outside-toplevel

  hf_dir = build_hf_model(str(tmp_path / "hf"), "deepseek")
  tensors, block = hf_tensors(hf_dir), 16
  dequantized = {}
  for name, weight in list(tensors.items()):
    if not name.endswith("proj.weight") or weight.ndim != 2:
      continue
    rows, cols = -(-weight.shape[0] // block), -(-weight.shape[1] // block)
    padded = torch.zeros(rows * block, cols * block)
    padded[: weight.shape[0], : weight.shape[1]] = weight
    blocks = padded.reshape(rows, block, cols, block)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # e4m3's largest normal
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[: weight.shape[0], : weight.shape[1]]
    quantized = (weight / full).to(torch.float8_e4m3fn)
    tensors[name], tensors[name + "_scale_inv"] = quantized, scale.float()
    dequantized[name] = (quantized.float() * full).to(torch.bfloat16).float()
  save_file(tensors, os.path.join(hf_dir, "model.safetensors"))
  with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as f:
    config = json.load(f)
  config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block]}
  with open(os.path.join(hf_dir, "config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f)
  converter.to_maxtext(hf_dir, str(tmp_path / "maxtext"))

  reference = build_hf_model(str(tmp_path / "reference"), "deepseek")  # the same random weights (same seed)
  save_file({**hf_tensors(reference), **dequantized}, os.path.join(reference, "model.safetensors"))
  tokens = logit_check.random_tokens(HF_TINY["vocab_size"])
  expected = logit_check.hf_logits(reference, tokens)
  max_abs, _ = logit_check.compare(expected, _logits(str(tmp_path / "maxtext"), tokens))
  assert max_abs < TOLERANCE, max_abs
  wrong = dict(config, quantization_config={"quant_method": "gptq", "bits": 4})
  with open(os.path.join(hf_dir, "config.json"), "w", encoding="utf-8") as f:
    json.dump(wrong, f)
  with pytest.raises(checkpointing.UserError, match="quantization_config gptq is not supported"):
    converter.to_maxtext(hf_dir, str(tmp_path / "maxtext_gptq"))


def _deepseek_mtp_tensors(mtp, layer: int, moe_intermediate: int) -> dict:
  """transformers' MtpModel depth 0 as DeepSeek-V3's checkpoints store it: layer `layer`'s tensors, per-expert."""
  out = {}
  for name, tensor in mtp.state_dict().items():
    name = name.removeprefix("layers.0.")
    if name.startswith(("embed_tokens", "shared_head")):
      continue
    name = name.replace("post_norm.", "shared_head.norm.").removeprefix("mtp_block.")
    if name.endswith("experts.gate_up_proj"):
      for e in range(tensor.shape[0]):
        out[f"mlp.experts.{e}.gate_proj.weight"] = tensor[e, :moe_intermediate]
        out[f"mlp.experts.{e}.up_proj.weight"] = tensor[e, moe_intermediate:]
    elif name.endswith("experts.down_proj"):
      for e in range(tensor.shape[0]):
        out[f"mlp.experts.{e}.down_proj.weight"] = tensor[e]
    else:
      out[name] = tensor
  return {f"model.layers.{layer}.{name}": t.contiguous() for name, t in out.items()}


def test_deepseek_multi_token_prediction_converts_and_matches_transformers(tmp_path):
  """DeepSeek-V3's checkpoints append the MTP depth as a further layer: it converts to decoder/mtp_1, its logits
  equal transformers' MtpModel's, its copies of the embedding and head are skipped, and the round trip is bitwise."""
  from safetensors.torch import save_file  # pylint: disable=import-outside-toplevel
  from transformers.modeling_layers import MtpModel  # pylint: disable=import-outside-toplevel

  hf_dir = build_hf_model(str(tmp_path / "hf"), "deepseek")
  main = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
  mtp = MtpModel(main, 1).to(torch.float32)
  randomize_hf_weights(mtp.layers, seed=5)  # not its embedding and head: the main model's own, shared
  layers, moe_intermediate = main.config.num_hidden_layers, main.config.moe_intermediate_size
  tensors = hf_tensors(hf_dir)
  tensors.update(_deepseek_mtp_tensors(mtp, layers, moe_intermediate))
  tensors[f"model.layers.{layers}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
  tensors[f"model.layers.{layers}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
  save_file(tensors, os.path.join(hf_dir, "model.safetensors"))
  converter.to_maxtext(hf_dir, str(tmp_path / "maxtext"))

  tokens = logit_check.random_tokens(HF_TINY["vocab_size"])
  _, sown = _logits(str(tmp_path / "maxtext"), tokens, intermediates=True)
  ours = np.asarray(sown["decoder"]["mtp_logits"][0])
  with torch.no_grad():
    ids = torch.from_numpy(np.asarray(tokens)).long()
    last_hidden = main(ids, output_hidden_states=True).hidden_states[-1]
    positions = torch.arange(ids.shape[1])[None]
    hidden = mtp.forward_layer(0, last_hidden, positions, None, input_ids=torch.roll(ids, -1, dims=1))
    theirs = mtp._project_to_logits(hidden).numpy()  # pylint: disable=protected-access
  max_abs, _ = logit_check.compare(theirs[:, :-1], ours[:, :-1])  # the last position has no token ahead
  print(f"MTP logits vs transformers: {max_abs:.3g}")
  assert max_abs < TOLERANCE, max_abs

  back = hf_tensors(converter.to_hf(str(tmp_path / "maxtext"), str(tmp_path / "hf_out")))
  skipped = {f"model.layers.{layers}.embed_tokens.weight", f"model.layers.{layers}.shared_head.head.weight"}
  assert sorted(back) == sorted(set(tensors) - skipped)
  for name, tensor in back.items():
    assert torch.equal(tensor, tensors[name]), name


@pytest.mark.slow
def test_readme_recipe_convert_train_convert_back(tmp_path):
  """docs/huggingface.md's fine-tuning recipe as a user runs it: convert, train 2 steps from model.yml, convert it back."""
  hf_dir = build_hf_model(str(tmp_path / "hf"), "llama")
  out = str(tmp_path / "out")
  result = _cli("to_maxtext", "--hf_path", hf_dir, "--output_dir", out, "--check_logits")
  assert result.returncode == 0, result.stderr
  assert "logit check: max_abs_diff=" in result.stdout
  train = run_python(
    [
      "MaxText/train.py",
      os.path.join(out, "model.yml"),
      "run_name=ft",
      f"base_output_directory={tmp_path / 'runs'}",
      f"load_parameters_path={os.path.join(out, 'params')}",
      "dataset_type=synthetic",
      "steps=2",
      "per_device_batch_size=1",
      "max_target_length=32",
      "enable_tensorboard=false",
      "async_checkpointing=false",
    ]
  )
  assert train.returncode == 0, train.stderr[-3000:]
  hf_out = str(tmp_path / "hf_ft")
  back = _cli("to_hf", "--maxtext_dir", str(tmp_path / "runs" / "ft"), "--output_dir", hf_out)
  assert back.returncode == 0, back.stderr
  tokens = logit_check.random_tokens(HF_TINY["vocab_size"])
  assert np.all(np.isfinite(logit_check.hf_logits(hf_out, tokens)))
