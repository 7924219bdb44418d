"""Analytic TFLOPs against upstream MaxText's published figures; device kinds to peaks and MFU."""

import pytest

from MaxText import pyconfig
from MaxText.tests.helpers import BASE_YML
from MaxText.training import flops


def _config(*args):
  return pyconfig.initialize(["t", BASE_YML, "run_name=x", *args], environ={})


def test_upstream_default_config_172_94_tflops_with_full_attention():
  # Upstream default: 1.1B params, per_device_batch_size 12, max_target_length 2048.
  config = _config("per_device_batch_size=12", "max_target_length=2048")
  full = flops.training_tflops_per_device(config, causal_attention=False)
  assert full.total_tflops == pytest.approx(172.94, abs=0.005)
  assert 100 * full.learnable_tflops / full.total_tflops == pytest.approx(88.56, abs=0.01)


def test_causal_count_halves_only_the_attention_part():
  config = _config("per_device_batch_size=12", "max_target_length=2048")
  full = flops.training_tflops_per_device(config, causal_attention=False)
  causal = flops.training_tflops_per_device(config)
  assert causal.learnable_tflops == full.learnable_tflops
  assert causal.attention_tflops == pytest.approx(full.attention_tflops / 2)
  assert causal.total_tflops == pytest.approx(172.94 - 0.1144 * 172.94 / 2, abs=0.01)


def test_llama2_7b_matches_upstream():
  config = _config("model_name=llama2-7b", "per_device_batch_size=1", "max_target_length=2048")
  assert flops.training_tflops_per_device(config, causal_attention=False).total_tflops == pytest.approx(87.78, abs=0.005)


def test_gradient_accumulation_multiplies_work_and_tokens():
  one = _config("per_device_batch_size=2", "max_target_length=128")
  four = _config("per_device_batch_size=2", "max_target_length=128", "gradient_accumulation_steps=4")
  assert flops.training_tflops_per_device(four).total_tflops == pytest.approx(
    4 * flops.training_tflops_per_device(one).total_tflops
  )
  assert flops.tokens_per_device_per_step(four) == 4 * 2 * 128


@pytest.mark.parametrize(
  "device_kind,generation",
  [  # device_kind as jax reports it on each machine
    ("TPU v4", "v4"),
    ("TPU v5 lite", "v5e"),
    ("TPU v5", "v5p"),
    ("TPU v6 lite", "v6e"),
    ("NVIDIA A100-SXM4-40GB", "a100"),
    ("NVIDIA A100 80GB PCIe", "a100"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA GH200 480GB", "gh200"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA B200", "b200"),
  ],
)
def test_device_kinds_map_to_their_generation(device_kind, generation):
  assert flops.device_generation(device_kind) == generation
  assert flops.device_generation(device_kind.upper()) == generation
  assert flops.peak_tflops_per_device(device_kind) == flops.PEAK_BF16_TFLOPS[generation]


@pytest.mark.parametrize("device_kind", ["cpu", "TPU v3", "TPU7x", "Tesla V100-SXM2-16GB", "NVIDIA L4", ""])
def test_unknown_devices_have_no_peak_and_no_mfu(device_kind):
  assert flops.device_generation(device_kind) is None
  assert flops.peak_tflops_per_device(device_kind) is None
  assert flops.mfu(100.0, device_kind) is None


def test_every_generation_has_a_peak_and_cheaper_variants_are_slower():
  mapped = {generation for _, generation in flops._DEVICE_KIND_GENERATIONS}  # pylint: disable=protected-access
  assert mapped == set(flops.PEAK_BF16_TFLOPS)
  peak = flops.peak_tflops_per_device
  assert peak("TPU v5 lite") < peak("TPU v4") < peak("TPU v5") < peak("TPU v6 lite")
  assert peak("NVIDIA A100-SXM4-80GB") < peak("NVIDIA H100 PCIe") < peak("NVIDIA H100 NVL") < peak("NVIDIA H100 80GB HBM3")
  assert peak("NVIDIA H100 80GB HBM3") < peak("NVIDIA B200")


def test_mfu_is_achieved_over_peak():
  v5e_peak = flops.PEAK_BF16_TFLOPS["v5e"]
  assert flops.mfu(v5e_peak / 4, "TPU v5 lite") == pytest.approx(0.25)
  # The same throughput is a smaller fraction of a v5p (reported as "TPU v5"), whose peak is higher.
  assert flops.mfu(v5e_peak / 4, "TPU v5") == pytest.approx(v5e_peak / 4 / flops.PEAK_BF16_TFLOPS["v5p"])


def test_mixture_of_experts_counts_the_experts_each_token_runs():
  """Mixtral 8x7B runs 12.9B of its 46.7B parameters per token (published); the input embedding is a lookup."""
  config = _config("model_name=mixtral-8x7b", "per_device_batch_size=1", "max_target_length=2048")
  active_matmul_params = 12.9e9 - config.vocab_size * config.emb_dim
  expected = 6 * active_matmul_params * 2048 / 1e12  # 2 FLOPs per multiply-add, x3 for forward and backward
  assert flops.training_tflops_per_device(config).learnable_tflops == pytest.approx(expected, rel=0.01)


def test_qwen3_moe_counts_the_active_experts():
  """qwen3-30b-a3b: 3 x 2 FLOPs per active weight and token; 3.35B active weights (8 of 128 experts, the router,
  attention and the untied logits; the embedding lookup is no matmul) = 3.04B in matmuls."""
  config = _config("model_name=qwen3-30b-a3b", "per_device_batch_size=1", "max_target_length=2048")
  step = flops.training_tflops_per_device(config)
  per_layer = 2048 * (32 + 2 * 4) * 128 + 32 * 128 * 2048 + 8 * 3 * 2048 * 768 + 2048 * 128
  active = 48 * per_layer + 2048 * 151936
  assert step.learnable_tflops * 1e12 == pytest.approx(6 * active * 2048, rel=1e-9)
