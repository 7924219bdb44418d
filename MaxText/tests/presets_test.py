"""Every model preset builds, and its parameter count (jax.eval_shape: nothing allocated) matches the published one."""

import pytest

from MaxText.configuration import config_loader
from MaxText.tests.helpers import BASE_YML, param_count

# preset -> (published parameter count, source). Counts are those of the released checkpoints (the Hugging Face
# safetensors totals); presets whose vocabulary is padded (Gemma: 256128 rows vs 256000) stay within 1%.
# Add a row for each new preset.
PUBLISHED = {
  "llama2-7b": (6_738_415_616, "meta-llama/Llama-2-7b-hf"),
  "llama2-13b": (13_015_864_320, "meta-llama/Llama-2-13b-hf"),
  "llama2-70b": (68_976_648_192, "meta-llama/Llama-2-70b-hf"),
  "llama3-8b": (8_030_261_248, "meta-llama/Meta-Llama-3-8B"),
  "llama3-70b": (70_553_706_496, "meta-llama/Meta-Llama-3-70B"),
  "llama3.1-8b": (8_030_261_248, "meta-llama/Llama-3.1-8B"),
  "llama3.1-70b": (70_553_706_496, "meta-llama/Llama-3.1-70B"),
  "llama3.1-405b": (405_853_388_800, "meta-llama/Llama-3.1-405B"),
  "mistral-7b": (7_241_732_096, "mistralai/Mistral-7B-v0.1"),
  "gemma-2b": (2_506_172_416, "google/gemma-2b"),
  "gemma-7b": (8_537_680_896, "google/gemma-7b"),
  "gemma2-2b": (2_614_341_888, "google/gemma-2-2b"),
  "gemma2-9b": (9_241_705_984, "google/gemma-2-9b"),
  "gemma2-27b": (27_227_128_320, "google/gemma-2-27b"),
  # Gemma 3: the text model, the technical report's Table 1 (embedding + non-embedding parameters; the vision
  # encoder's 417M left out). 1b's equals google/gemma-3-1b-pt's safetensors total, 999,885,952.
  "gemma3-1b": (1_000_000_000, "Gemma 3 Technical Report, Table 1: 302M embedding + 698M non-embedding"),
  "gemma3-4b": (3_884_000_000, "Gemma 3 Technical Report, Table 1: 675M + 3,209M (vision encoder 417M apart)"),
  "gemma3-12b": (11_771_000_000, "Gemma 3 Technical Report, Table 1: 1,012M + 10,759M (vision encoder 417M apart)"),
  "gemma3-27b": (27_016_000_000, "Gemma 3 Technical Report, Table 1: 1,416M + 25,600M (vision encoder 417M apart)"),
  # Without the multi-token prediction module (the Hugging Face checkpoint's 685B include its 14B).
  "deepseek3-671b": (671_000_000_000, "DeepSeek-V3 Technical Report: 671B total parameters, 37B activated"),
  # Llama 4: the text model (llama4_test.py checks the exact count against transformers' of the same config).
  "llama4-17b-16e": (107_800_000_000, "meta-llama/Llama-4-Scout-17B-16E: 17B active, 16 experts; text model 107.8B"),
  "llama4-17b-128e": (400_000_000_000, "meta-llama/Llama-4-Maverick-17B-128E model card: 17B active, 400B total"),
  "gpt3-175b": (175_000_000_000, "Brown et al. 2020, Language Models are Few-Shot Learners, Table 2.1 (175.0B)"),
  "qwen3-0.6b": (596_049_920, "Qwen/Qwen3-0.6B"),
  "qwen3-8b": (8_190_735_360, "Qwen/Qwen3-8B"),
  "qwen3-30b-a3b": (30_500_000_000, "Qwen/Qwen3-30B-A3B model card: 30.5B in total, 3.3B activated"),
  "qwen3-235b-a22b": (235_000_000_000, "Qwen/Qwen3-235B-A22B model card: 235B in total, 22B activated"),
  # The unquantized count (transformers' GptOssForCausalLM of the released config; gpt_oss_test.py checks it to 0.1%).
  "gpt-oss-20b": (20_914_757_184, "openai/gpt-oss-20b model card: 21B in total, 3.6B active"),
  "gpt-oss-120b": (116_829_156_672, "openai/gpt-oss-120b model card: 117B in total, 5.1B active"),
}


def _gpt3_count(emb, layers, mlp, vocab, positions):
  """Upstream's GPT-3-style test sizes have no published checkpoint: the closed form of the architecture.

  Per layer: q/k/v/out kernels 4 E^2 and biases 4 E, MLP 2 E M + M + E, two LayerNorms 4 E.
  """
  per_layer = 4 * emb * emb + 4 * emb + 2 * emb * mlp + mlp + emb + 4 * emb
  return layers * per_layer + (vocab + positions) * emb + 2 * emb


def _deepseek_count(emb, heads, mlp, moe_mlp, layers, dense, experts, shared, q_lora, kv_lora, nope, rope, v, vocab):
  """DeepSeek-V3's architecture in closed form: latent attention (q and kv low-rank projections with their norms),
  two norms per layer, dense gated MLPs, then routed experts (router kernel and selection bias) and shared experts;
  untied embedding and logits, final norm."""
  attention = emb * q_lora + q_lora + q_lora * heads * (nope + rope) + emb * (kv_lora + rope) + kv_lora
  attention += kv_lora * heads * (nope + v) + heads * v * emb
  moe = emb * experts + experts + (experts + shared) * 3 * emb * moe_mlp
  return layers * (attention + 2 * emb) + dense * 3 * emb * mlp + (layers - dense) * moe + 2 * vocab * emb + emb


# Presets without a published count: (closed-form count, why).
UNPUBLISHED = {
  "gpt3-52k": (_gpt3_count(16, 1, 64, 1024, 2048), "upstream MaxText test size"),
  "gpt3-6b": (_gpt3_count(3072, 48, 12288, 32768, 16384), "upstream MaxText size"),
  "gpt3-22b": (_gpt3_count(6144, 48, 24576, 32768, 16384), "upstream MaxText size"),
  "deepseek3-test": (_deepseek_count(512, 8, 1536, 256, 4, 1, 16, 1, 128, 64, 32, 16, 32, 129280), "a test size"),
}


def test_every_preset_has_a_count():
  presets = set(config_loader.list_model_presets(BASE_YML.rsplit("/", 1)[0]))
  assert presets == set(PUBLISHED) | set(UNPUBLISHED) | {p for p in presets if p.startswith("mixtral")}


@pytest.mark.parametrize("model_name", sorted(PUBLISHED))
def test_parameter_count_matches_the_published_one(model_name):
  published, source = PUBLISHED[model_name]
  count = param_count(model_name)
  assert count == pytest.approx(published, rel=0.01), f"{model_name}: {count:,} vs {published:,} ({source})"


@pytest.mark.parametrize("model_name", sorted(UNPUBLISHED))
def test_parameter_count_matches_the_closed_form(model_name):
  expected, _ = UNPUBLISHED[model_name]
  assert param_count(model_name) == expected


def test_deepseek3_with_multi_token_prediction_matches_685b():
  """DeepSeek-V3 Technical Report: 685B with the MTP module. MaxText shares the embedding and head with it (the
  checkpoint keeps copies, 2 x 129280 x 7168 = 1.85B): 682.64B here."""
  assert param_count("deepseek3-671b", "mtp_num_layers=1") == pytest.approx(685e9, rel=0.01)
