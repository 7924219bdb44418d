"""Analytic TFLOPs against upstream MaxText's published figures, and the peak table."""

import pytest

from MaxText import flops, pyconfig
from MaxText.tests.helpers import BASE_YML


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
  "kind,peak",
  [
    ("TPU v4", 275.0),
    ("TPU v5 lite", 197.0),
    ("TPU v5", 459.0),
    ("TPU v5p", 459.0),
    ("TPU v6 lite", 918.0),
    ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA H100 80GB HBM3", 989.0),
    ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA H200", 989.0),
    ("NVIDIA B200", 2250.0),
    ("cpu", None),
  ],
)
def test_peak_table(kind, peak):
  assert flops.peak_tflops_per_device(kind) == peak
