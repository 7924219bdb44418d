"""Which attention kernel a config gets on CPU, GPU and TPU devices, and the one-line errors of the GPU kernels."""

import importlib.util
import re

import pytest

from MaxText.configuration import attention_selection
from MaxText.errors import ConfigError
from MaxText.tests.helpers import tiny_config

_TE_INSTALLED = importlib.util.find_spec("transformer_engine") is not None


def _values(**overrides):
  values = {
    "attention": "autoselected",
    "dtype": "bfloat16",
    "attn_logits_soft_cap": 0.0,
    "head_dim": 128,
    "sliding_window_size": 0,
    "ici_sequence_parallelism": 1,
    "dcn_sequence_parallelism": 1,
    "max_target_length": 4096,
    "dataset_type": "synthetic",
    "packing": True,
  }
  return {**values, **overrides}


@pytest.mark.parametrize(
  "platform, overrides, kernel",
  [
    ("cpu", {}, "dot_product"),
    ("tpu", {}, "flash"),
    ("tpu", {"max_target_length": 64}, "dot_product"),  # the splash kernel's blocks do not tile it
    ("tpu", {"max_target_length": 768}, "dot_product"),
    ("gpu", {}, "cudnn_flash_jax"),
    ("gpu", {"dtype": "float32"}, "dot_product"),
    ("gpu", {"attn_logits_soft_cap": 50.0}, "dot_product"),
    ("gpu", {"head_dim": 260}, "dot_product"),
    ("gpu", {"ici_sequence_parallelism": 2}, "dot_product"),
  ],
)
def test_autoselected(platform, overrides, kernel):
  assert attention_selection.select(_values(**overrides), platform) == kernel


@pytest.mark.parametrize(
  "kernel, platform, overrides, message",
  [
    ("cudnn_flash_jax", "cpu", {}, "attention=cudnn_flash_jax needs a GPU (cuDNN); this machine has cpu devices"),
    ("cudnn_flash_te", "tpu", {}, "attention=cudnn_flash_te needs a GPU"),
    ("cudnn_flash_jax", "gpu", {"dtype": "float32"}, "cannot run with dtype=float32 (cuDNN flash attention needs"),
    ("cudnn_flash_jax", "gpu", {"attn_logits_soft_cap": 50.0}, "cannot run with attn_logits_soft_cap=50.0"),
    ("cudnn_flash_jax", "gpu", {"head_dim": 100}, "cannot run with head_dim=100"),
    ("cudnn_flash_te", "gpu", {"dataset_type": "tfds"}, "packing=true with dataset_type=tfds"),
    ("cudnn_flash_te", "gpu", {"sliding_window_size": 64}, "sliding_window_size=64"),
  ],
)
def test_gpu_kernel_errors(kernel, platform, overrides, message):
  with pytest.raises(ConfigError, match=re.escape(message)):
    attention_selection.select(_values(attention=kernel, **overrides), platform)


@pytest.mark.skipif(_TE_INSTALLED, reason="TransformerEngine is installed here")
def test_te_not_installed_names_the_setup_extra():
  with pytest.raises(ConfigError, match="bash setup.sh DEVICE=gpu TE=1"):
    attention_selection.select(_values(attention="cudnn_flash_te"), "gpu")


def test_cudnn_segments_follow_the_data():
  assert attention_selection.cudnn_segments("synthetic", True) == "causal"
  assert attention_selection.cudnn_segments("tfds", False) == "lengths"
  assert attention_selection.cudnn_segments("tfds", True) == "mask"


def test_config_resolves_autoselected_on_cpu_and_refuses_a_gpu_kernel():
  assert tiny_config().attention == "dot_product"
  with pytest.raises(ConfigError, match="attention=cudnn_flash_jax needs a GPU"):
    tiny_config("attention=cudnn_flash_jax")


def test_the_devices_of_the_config_decide_not_this_host():
  """An AOT target's GPUs (train_compile.py) allow the GPU kernels on a CPU host; autoselected picks cuDNN."""
  import types  # pylint: disable=import-outside-toplevel

  from MaxText import pyconfig  # pylint: disable=import-outside-toplevel
  from MaxText.tests.helpers import BASE_YML, tiny_args  # pylint: disable=import-outside-toplevel

  gpus = [types.SimpleNamespace(platform="gpu", id=i, slice_index=0, process_index=0) for i in range(8)]

  def attention(*args):
    argv = ["test", BASE_YML, "run_name=t", *tiny_args("dtype=bfloat16", *args)]
    return pyconfig.initialize(argv, environ={}, devices=gpus).attention

  assert attention() == "cudnn_flash_jax"
  assert attention("attention=cudnn_flash_jax") == "cudnn_flash_jax"
  assert attention("dtype=float32") == "dot_product"


def test_kernels_without_sinks_refuse_them_in_one_line():
  """cuDNN's kernels and ring attention cannot carry the sinks: one ConfigError line each; autoselected takes
  dot_product on GPU."""
  from MaxText.configuration import attention_selection  # pylint: disable=import-outside-toplevel
  from MaxText.errors import ConfigError  # pylint: disable=import-outside-toplevel

  values = _values(attention_sink=True)
  assert attention_selection.select(values, "gpu") == "dot_product"
  with pytest.raises(ConfigError) as error:
    attention_selection.select({**values, "attention": "cudnn_flash_jax"}, "gpu")
  assert str(error.value) == (
    "attention=cudnn_flash_jax cannot run with attention_sink=true (the cuDNN kernels here take no sinks; dot_product "
    "and flash do); use attention=dot_product"
  )
  ring = {"max_target_length": 1024, "context_parallel_load_balance": True, "context_parallel_strategy": "ring"}
  ring.update(num_query_heads=4, num_kv_heads=4, logical_axis_rules=[])
  with pytest.raises(ConfigError, match="^context_parallel_strategy=ring cannot carry attention_sink=true"):
    attention_selection.check_length_sharding({**ring, "attention": "dot_product", "attention_sink": True}, {"context": 4})
