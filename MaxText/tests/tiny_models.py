"""Tiny models shared by several tests: MaxText configs of each family, Hugging Face reference models built here
(nothing is downloaded), and in-process computations on them (decoding, a quantized GEMM, train steps, LoRA logits).
(The tiny model's config, subprocess runs and the tiny data: helpers.py.)"""

import os

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.aot import aot_compile
from MaxText.inference import decoding
from MaxText.layers import linears, quantizations
from MaxText.runtime import mesh, sharding
from MaxText.tests.helpers import tiny_config, token_batch
from MaxText.training import training_setup

# ---- MaxText configs ----------------------------------------------------------------------------------------------

# A tiny DeepSeek-V3: 1 dense layer, then 2 MoE layers of 8 experts in 4 groups (2 searched), k 2, a shared expert;
# latent attention with a query bottleneck and YaRN. (The loss gate's recorded figures depend on it.)
DEEPSEEK = [
  "decoder_block=deepseek",
  "base_num_decoder_layers=3",
  "first_num_dense_layers=1",
  "num_experts=8",
  "num_experts_per_tok=2",
  "n_routing_groups=4",
  "topk_routing_group=2",
  "base_moe_mlp_dim=16",
  "routed_scaling_factor=2.5",
  "q_lora_rank=16",
  "kv_lora_rank=8",
  "qk_nope_head_dim=8",
  "qk_rope_head_dim=4",
  "v_head_dim=6",
  "rope_type=yarn",
  "rope_factor=4",
  "original_max_position_embeddings=16",
]

# A tiny GPT-OSS: every option of the family on the tiny model's dims (4 experts, window 8 of 32 tokens).
TINY_GPT_OSS = [
  "decoder_block=gpt_oss",
  "num_experts=4",
  "num_experts_per_tok=2",
  "sliding_window_size=8",
  "attention_sink=true",
  "mlp_bias=true",
  "routed_bias=true",
  "mlp_activations_limit=7.0",
  "rope_type=yarn",
  "rope_factor=4",
  "original_max_position_embeddings=16",
]

# A tiny Llama 4: one block of 4 layers (dense and MoE alternating, the 4th NoPE), on helpers.TINY_MODEL's
# dims (emb 32, 4/2 heads of 8), chunks of 8 of its 32 tokens, the temperature changing every 4 positions.
TINY_LLAMA4 = [
  "decoder_block=llama4",
  "base_num_decoder_layers=4",
  "num_experts=4",
  "base_moe_mlp_dim=32",
  "interleave_moe_layer_step=2",
  "nope_layer_interval=4",
  "chunk_attn_window_size=8",
  "use_qk_norm=true",
  "temperature_tuning=true",
  "temperature_tuning_floor_scale=4",
]

# Tiny configs of each family: the options that make it that family, on TINY_MODEL dims (E=32, D=8, 4/2 heads).
FAMILIES = {
  "llama2": [
    "rope_scaling_factor=8",
    "rope_scaling_high_freq_factor=8",
    "rope_scaling_original_max_position_embeddings=256",
  ],
  "mistral": ["sliding_window_size=5"],
  "gemma": ["mlp_activations=[gelu,linear]", "logits_via_embedding=true", "normalize_embedding_logits=false"],
  "gemma2": [
    "mlp_activations=[gelu,linear]",
    "logits_via_embedding=true",
    "normalize_embedding_logits=false",
    "base_num_decoder_layers=4",
    "sliding_window_size=5",
    "attn_logits_soft_cap=2.0",
    "final_logits_soft_cap=3.0",
    "use_post_attn_norm=true",
    "use_post_ffw_norm=true",
    "query_pre_attn_scalar=12",
  ],
  # 8 layers: 6 (the last global) and 2 more local ones; each kind with its RoPE base, the global one scaled.
  "gemma3": [
    "mlp_activations=[gelu,linear]",
    "logits_via_embedding=true",
    "normalize_embedding_logits=false",
    "base_num_decoder_layers=8",
    "sliding_window_size=5",
    "rope_max_timescale=1000000",
    "local_rope_max_timescale=100",
    "rope_linear_scaling_factor=8",
    "use_post_attn_norm=true",
    "use_post_ffw_norm=true",
    "query_pre_attn_scalar=12",
  ],
  "gpt3": [
    "mlp_activations=[gelu]",
    "trainable_position_size=64",
    "logits_via_embedding=true",
    "normalize_embedding_logits=false",
    "base_num_kv_heads=4",
  ],
  "qwen3": ["normalization_layer_epsilon=1e-6"],
}


# ---- Hugging Face reference models ----------------------------------------------------------------------------------

# The dims of convert_checkpoint_test's tiny Hugging Face models (build_hf_model), of every family.
HF_TINY = {
  "hidden_size": 64,
  "intermediate_size": 96,
  "num_hidden_layers": 2,
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "head_dim": 16,
  "vocab_size": 256,
}
# HF_FAMILIES: family -> (model_type, config.json keys over HF_TINY). Sliding windows are 16, so the 64-token check
# covers 4 windows.
HF_LLAMA31_ROPE = {
  "rope_type": "llama3",
  "rope_theta": 500000.0,
  "factor": 8.0,
  "low_freq_factor": 1.0,
  "high_freq_factor": 4.0,
  "original_max_position_embeddings": 16,  # wavelengths of 4..16 tokens are smoothed, longer ones divided by 8
}
HF_FAMILIES = {
  "llama": ("llama", {}),
  "llama-tied": ("llama", {"tie_word_embeddings": True}),
  "llama3.1": ("llama", {"rope_parameters": HF_LLAMA31_ROPE}),
  "mistral": ("mistral", {"sliding_window": 16}),
  "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16}),
  "gemma": ("gemma", {}),
  "gemma2": ("gemma2", {"sliding_window": 16}),  # query_pre_attn_scalar 256, soft caps 50 and 30 (defaults)
  # 8 layers: a global one (layer 5) among local ones, and 2 after the last whole pattern of 6 (as 1b's 26).
  "gemma3": (
    "gemma3_text",
    {
      "num_hidden_layers": 8,
      "sliding_window": 16,
      "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
      },
    },
  ),
  "qwen3": ("qwen3", {}),
  # 3 layers: 1 dense, 2 MoE (8 experts in 4 groups, 2 of them searched, k 2, 1 shared), YaRN, q through q_lora_rank
  "deepseek": (
    "deepseek_v3",
    {
      "num_hidden_layers": 3,
      "first_k_dense_replace": 1,
      "n_routed_experts": 8,
      "num_experts_per_tok": 2,
      "n_group": 4,
      "topk_group": 2,
      "n_shared_experts": 1,
      "moe_intermediate_size": 24,
      "routed_scaling_factor": 2.5,
      "q_lora_rank": 32,
      "kv_lora_rank": 16,
      "qk_nope_head_dim": 16,
      "qk_rope_head_dim": 8,
      "head_dim": 8,  # transformers' rotary embedding's width: qk_rope_head_dim
      "num_key_value_heads": 4,  # as many as query heads: latent attention has none of its own
      "v_head_dim": 12,
      "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
      },
    },
  ),
  "qwen3_moe": (
    "qwen3_moe",
    {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": True},
  ),
}

# A tiny SigLIP of Gemma 3 (Gemma3Config's vision_config): 56-pixel images, 16 patches of 14 pixels, no pooling head.
HF_GEMMA3_VISION = {
  "hidden_size": 32,
  "intermediate_size": 64,
  "num_hidden_layers": 2,
  "num_attention_heads": 2,
  "image_size": 56,
  "patch_size": 14,
  "vision_use_head": False,
}


def randomize_hf_weights(model, seed: int) -> None:
  """Weights of order 1/sqrt(fan_in) and norms around 1, so that logits are O(1) and every weight matters."""
  import torch  # pylint: disable=import-outside-toplevel

  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for _, p in sorted(model.named_parameters()):
      if p.ndim == 1:
        p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
      else:
        p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[-1]))
    for name, b in sorted(model.named_buffers()):
      if name.endswith("e_score_correction_bias"):  # DeepSeek's routing bias: a buffer, zeros unless set
        b.copy_(0.2 * torch.randn(b.shape, generator=gen))


def hf_tensors(hf_dir: str) -> dict:
  """{name: torch tensor} of every safetensors file of a Hugging Face directory."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel

  out = {}
  for name in sorted(os.listdir(hf_dir)):
    if name.endswith(".safetensors"):
      with safe_open(os.path.join(hf_dir, name), framework="pt") as f:
        out.update({k: f.get_tensor(k) for k in f.keys()})
  return out


def build_hf_model(directory: str, family: str, dtype=None, **save_kwargs) -> str:
  """A tiny random transformers model of HF_FAMILIES[family] saved to directory (dtype: torch.float32 if None)."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  model_type, extra = HF_FAMILIES[family]
  config = transformers.AutoConfig.for_model(model_type, **{**HF_TINY, **extra})
  model = transformers.AutoModelForCausalLM.from_config(config)
  randomize_hf_weights(model, seed=len(family))
  model.to(torch.float32 if dtype is None else dtype).save_pretrained(directory, **save_kwargs)
  return directory


# The SFT, DPO, LoRA and QLoRA tests' tiny llama (vocab 320: the chat tokenizer's), randomized its own way. Not
# build_hf_model's "llama" (vocab 256, other random weights), which convert_checkpoint_test's figures rest on.
HF_LLAMA = dict(
  hidden_size=64,
  intermediate_size=96,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  vocab_size=320,
)


def hf_llama(directory, **overrides) -> str:
  """A tiny random transformers llama (HF_LLAMA with `overrides`) saved to directory, the same weights each time."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**HF_LLAMA, **overrides})).to(torch.float32)
  with torch.no_grad():
    for p in model.parameters():  # weights of order 1/sqrt(fan_in): logits O(1), every weight matters
      p.copy_(1.0 + 0.2 * torch.randn_like(p) if p.ndim == 1 else torch.randn_like(p) / np.sqrt(p.shape[-1]))
  model.save_pretrained(str(directory))
  return str(directory)


# ---- decoding -------------------------------------------------------------------------------------------------------

DECODE_PROMPT = [1, 5, 9, 200, 7, 31]  # 6 tokens, padded to max_prefill_predict_length=8; 16 more are generated
# Decoding's keys over the tiny model: 24 tokens, the first 8 the prefill.
DECODE_KEYS = ["max_target_length=24", "max_prefill_predict_length=8", "per_device_batch_size=2", "remat_policy=none"]


def decode_with_logits(config, prompt=DECODE_PROMPT, end_ids=()):
  """decoding.generate on fresh params, keeping the logits: (model, params, device_mesh, its result)."""
  device_mesh = mesh.create_device_mesh(config)
  model, abstract = decoding.build(config, device_mesh)
  params = decoding.load_params(config, model, abstract, device_mesh)
  result = decoding.generate(config, model, params, device_mesh, prompt, end_ids, keep_logits=True)
  return model, params, device_mesh, result


def full_forward_logits(config, model, params, device_mesh, prompt, tokens):
  """Logits of a forward pass over prompt + generated tokens, without the cache, at the positions that sampled."""
  sequence = np.concatenate([np.tile(prompt, (tokens.shape[0], 1)), tokens], axis=1)
  positions = np.broadcast_to(np.arange(sequence.shape[1]), sequence.shape)
  with sharding.logical_context(device_mesh, config):
    logits = model.apply({"params": params}, jnp.asarray(sequence), jnp.asarray(positions))
  return np.asarray(logits)[:, len(prompt) - 1 : -1]  # (B, N, V): position t's logits sample token t + 1


# ---- quantization -------------------------------------------------------------------------------------------------

GEMM_DIMS = (((2,), (0,)), ((), ()))  # gemm_and_grads' dimension numbers: x (2, 8, 16) . kernel (16, 32)


def make_quantization(mode, numerics=None, scanned_blocks=0):
  """A Quantization as from_config makes it with base.yml's fp8 keys; numerics None: no numerics YAML."""
  from MaxText.diagnostics import numerics_config  # pylint: disable=import-outside-toplevel

  numerics = numerics_config.NumericsDebugConfig() if numerics is None else numerics
  stacks = (("layers", 0, scanned_blocks),) if scanned_blocks else ()
  return quantizations.Quantization(mode, False, 1024, numerics, stacks, scanned=bool(scanned_blocks))


def gemm_and_grads(gemm):
  """(y, dx, dkernel) of y = gemm(x, kernel) for a fixed cotangent of y."""
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 16))
  kernel = jax.random.normal(jax.random.PRNGKey(1), (16, 32)) * 0.1
  g = jax.random.normal(jax.random.PRNGKey(2), (2, 8, 32))
  y, vjp = jax.vjp(lambda x, k: gemm(x, k, GEMM_DIMS), x, kernel)
  return (y, *vjp(g))


def dense_outputs(*args):
  """Every DenseGeneral output of the tiny model's forward pass (scanned ones stacked by layer)."""
  config = tiny_config(*args)
  model = training_setup.create_model(config)
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, config.vocab_size, (2, config.max_target_length)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  params = model.init({"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(0)}, tokens, positions)["params"]
  capture = lambda module, _: isinstance(module, linears.DenseGeneral)  # noqa: E731
  _, state = model.apply({"params": params}, tokens, positions, capture_intermediates=capture, mutable=["intermediates"])
  return dict(jax.tree_util.tree_flatten_with_path(state["intermediates"]["decoder"])[0])


# ---- train steps in this process ----------------------------------------------------------------------------------


def next_token_batch(tokens: np.ndarray) -> dict:
  """The train batch of whole rows of `tokens` (B, T): each token's target is the next one (the last wraps)."""
  positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
  ones = np.ones(tokens.shape, np.int32)
  return dict(
    inputs=tokens,
    targets=np.roll(tokens, -1, axis=1),
    inputs_position=positions,
    targets_position=positions,
    inputs_segmentation=ones,
    targets_segmentation=ones,
  )


def train_on_one_batch(*args, steps: int):
  """Losses of `steps` train steps of the tiny model (tiny_config(*args)) on one repeated batch, and the final state."""
  config = tiny_config("learning_rate=1e-2", "warmup_steps_fraction=0", *args)
  device_mesh = mesh.create_device_mesh(config)
  setup = training_setup.build(config, device_mesh)
  state = setup.init_state(config, device_mesh)
  step = aot_compile.compile_train_step(setup, config, device_mesh)
  shape = (config.global_batch_size_to_load, config.max_target_length)
  tokens = np.random.default_rng(0).integers(1, 64, shape).astype(np.int32)
  batch = jax.device_put(next_token_batch(tokens), sharding.data_sharding(config, device_mesh))
  losses = []
  with sharding.logical_context(device_mesh, config):
    for _ in range(steps):
      state, metrics = step(state, batch)
      losses.append(float(metrics["learning/loss"]))
  return np.asarray(losses), state


def padded_token_batch():
  """token_batch's two rows of 32 tokens (seed 1), the second padded from token 20."""
  return token_batch(segmentation=jnp.ones((2, 32), jnp.int32).at[1, 20:].set(0), seed=1)


def run_train_steps(config, steps: int):
  """The real compiled train step on a fresh state for `steps` steps: (params before step 0, metrics per step)."""
  device_mesh = mesh.create_device_mesh(config)
  setup = training_setup.build(config, device_mesh)
  state = setup.init_state(config, device_mesh)
  params = jax.device_get(state.params)
  step = aot_compile.compile_train_step(setup, config, device_mesh)
  batch = jax.device_put(padded_token_batch(), sharding.data_sharding(config, device_mesh))
  metrics = []
  with sharding.logical_context(device_mesh, config):
    for _ in range(steps):
      state, m = step(state, batch)
      metrics.append(jax.device_get(m))
  return params, metrics


# ---- LoRA ---------------------------------------------------------------------------------------------------------


def nonzero_lora_b(params):
  """params with 0.01 added to every lora_b: a trained-looking B, so that A gets a gradient too."""

  def fill(path, x):
    return x + 0.01 if str(getattr(path[-1], "key", "")) == "lora_b" else x

  return jax.tree_util.tree_map_with_path(fill, params)


def lora_logits(run_dir: str, base_params: str, model_yml: str, tokens: np.ndarray) -> np.ndarray:
  """Our LoRA model's float32 logits: the run's config and latest checkpoint's adapters over the base params."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel

  from MaxText.checkpoints import checkpointing  # pylint: disable=import-outside-toplevel
  from MaxText.features import lora  # pylint: disable=import-outside-toplevel
  from MaxText.hf_conversion import converter  # pylint: disable=import-outside-toplevel

  run_config, items = converter.load_maxtext_dir(run_dir)
  keys = ("enable_lora", "lora_rank", "lora_alpha", "lora_module_path")
  config = converter.maxtext_config(
    model_yml,
    dtype="float32",
    weight_dtype="float32",
    max_target_length=tokens.shape[1],
    **{k: getattr(run_config, k) for k in keys},
  )
  model = training_setup.create_model(config)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  abstract = jax.eval_shape(lambda: model.init({"params": jax.random.PRNGKey(0)}, tokens, positions))["params"]
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), nn.unbox(abstract))
  base, adapters = lora.split(abstract)
  params = lora.join(
    checkpointing.load_params(base_params, base, config.param_scan_axis),
    checkpointing.load_params(items, adapters, config.param_scan_axis),
  )
  with jax.default_matmul_precision("float32"):
    return np.asarray(model.apply({"params": params}, tokens, positions))


def exports_give_our_logits(tmp_path, run_dir, hf_dir, base_params, model_yml, tokens, label="") -> np.ndarray:
  """Exports the LoRA run to tmp_path/peft (PEFT) and tmp_path/merged (--merge_lora); asserts that PeftModel on the
  HF base and the merged model give our LoRA model's logits (1e-4) and that the adapters moved it; returns ours."""
  import peft  # pylint: disable=import-outside-toplevel  # requirements-test.txt
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  from MaxText import convert_checkpoint  # pylint: disable=import-outside-toplevel
  from MaxText.hf_conversion import logit_check  # pylint: disable=import-outside-toplevel

  convert_checkpoint.main(["c", "to_hf", "--maxtext_dir", run_dir, "--output_dir", str(tmp_path / "peft")])
  convert_checkpoint.main(["c", "to_hf", "--maxtext_dir", run_dir, "--output_dir", str(tmp_path / "merged"), "--merge_lora"])
  ours = lora_logits(run_dir, base_params, model_yml, tokens)
  base_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
  peft_model = peft.PeftModel.from_pretrained(base_model, str(tmp_path / "peft")).eval()
  with torch.no_grad():
    peft_logits = peft_model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
  merged_logits = logit_check.hf_logits(str(tmp_path / "merged"), tokens)
  base_logits = logit_check.hf_logits(hf_dir, tokens)
  peft_diff, merged_diff = np.max(np.abs(peft_logits - ours)), np.max(np.abs(merged_logits - ours))
  print(f"\n{label}LoRA logits: PEFT vs ours {peft_diff:.2e}, merged vs ours {merged_diff:.2e}")
  assert np.max(np.abs(base_logits - ours)) > 1e-2  # the adapters moved the model
  assert peft_diff < 1e-4 and merged_diff < 1e-4
  return ours
