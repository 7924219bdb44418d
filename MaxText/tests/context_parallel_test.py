"""Context parallelism: 8 CPU devices give the 1-device losses with the sequence split over `context` (both strategies,
load balancing on and off, packed documents, a sliding window), load balancing evens out the causal work, and each
unsupported combination is one clear line."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import pyconfig
from MaxText.configuration import attention_selection
from MaxText.errors import ConfigError
from MaxText.layers import attention_masks, context_parallel
from MaxText.tests.helpers import BASE_YML, REPO_ROOT, cpu_env, run_python, tiny_args

DECODE_PY = f"{REPO_ROOT}/MaxText/decode.py"

CONTEXT4_FSDP2 = ["ici_context_parallelism=4", "ici_fsdp_parallelism=2"]
# One batch shard, as on one device: the hf pipeline then packs the same rows (it packs per data shard).
CONTEXT4_TENSOR2 = ["ici_context_parallelism=4", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=1"]
CONTEXT2_TENSOR2_DATA2 = [
  "ici_context_parallelism=2",
  "ici_tensor_parallelism=2",
  "ici_data_parallelism=2",
  "ici_fsdp_parallelism=1",
]
RING, NO_BALANCE = ["context_parallel_strategy=ring"], ["context_parallel_load_balance=false"]
WINDOW = ["sliding_window_size=5"]
QUERY = "decoder/layers/self_attention/query"  # (layers, B, T, heads, head_dim): split over the context axis

# name -> (devices, args, the 1-device run it must match)
RUNS = {
  "one": (1, [], None),
  "all_gather": (8, CONTEXT4_FSDP2, "one"),
  "all_gather_unbalanced": (8, CONTEXT4_FSDP2 + NO_BALANCE, "one"),
  "ring": (8, CONTEXT4_FSDP2 + RING, "one"),
  "ring_unbalanced": (8, CONTEXT4_FSDP2 + RING + NO_BALANCE, "one"),
  "packed_one": (1, ["packed"], None),
  "packed_all_gather": (8, ["packed", *CONTEXT4_TENSOR2], "packed_one"),
  "packed_ring": (8, ["packed", *CONTEXT4_TENSOR2, *RING], "packed_one"),
  "window_one": (1, WINDOW, None),
  "window_all_gather": (8, WINDOW + CONTEXT2_TENSOR2_DATA2, "window_one"),
  "window_ring": (8, WINDOW + CONTEXT2_TENSOR2_DATA2 + RING, "window_one"),
}


def _short_documents(path):
  """A jsonl of 2-12 word texts: several documents (segments) per 32-token row once packed."""
  rng = np.random.default_rng(0)
  words = "the cat sat on a mat while dogs ran far away into fields of green grass under blue sky".split()
  lines = [json.dumps({"text": " ".join(rng.choice(words, rng.integers(2, 13)))}) for _ in range(400)]
  path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  tmp_path = tmp_path_factory.mktemp("context")
  documents = tmp_path / "short.jsonl"
  _short_documents(documents)
  packed = ["dataset_type=hf", "hf_path=json", f"hf_train_files={documents}", "enable_data_shuffling=false"]
  runs = []
  for name, (devices, args, _) in RUNS.items():
    args = [a for arg in args for a in (packed if arg == "packed" else [arg])]
    common = [f"base_output_directory={tmp_path}", f"run_name={name}", "steps=4", "learning_rate=1e-2"]
    common += ["enable_checkpointing=false", f"metrics_file={tmp_path / name}.jsonl"]
    common += ["per_device_batch_size=8" if devices == 1 else "per_device_batch_size=1"]
    probes = [QUERY] if devices > 1 else []
    runs.append({"name": name, "devices": devices, "args": tiny_args(*common, *args), "decode": False, "probes": probes})
  runs_path, report_path = tmp_path / "runs.json", tmp_path / "report.json"
  runs_path.write_text(json.dumps(runs))
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0", "JAX_PLATFORMS": "cpu"}
  result = run_python(["-m", "MaxText.tests.sharded_runs", str(runs_path), str(report_path)], env_extra=env)
  assert result.returncode == 0, result.stderr[-5000:]
  return json.loads(report_path.read_text())


@pytest.mark.parametrize("name", [name for name, (_, _, baseline) in RUNS.items() if baseline])
def test_context_parallel_losses_equal_one_device(report, name):
  devices, args, baseline = RUNS[name]
  run = report[name]
  for arg in args:
    if arg.startswith("ici_"):
      axis = arg.removeprefix("ici_").split("_parallelism")[0]
      assert run["mesh"][axis] == int(arg.split("=")[1]), run["mesh"]
  np.testing.assert_allclose(run["metrics"]["learning/loss"], report[baseline]["metrics"]["learning/loss"], rtol=1e-5)
  context = run["mesh"]["context"]
  assert run["activations"][QUERY][0][2] == 32 // context, run["activations"][QUERY]
  assert run["metrics"]["learning/total_weights"] == report[baseline]["metrics"]["learning/total_weights"]


def _causal_work(layout, length: int) -> np.ndarray:
  """Unmasked (query, key) pairs per shard of the layout: the causal mask's rows, cut into the shards."""
  order = layout.token_order(length)
  mask = np.asarray(attention_masks.attention_mask(jnp.ones((1, length), jnp.int32), order=order))[0, 0, 0]
  return mask.reshape(layout.context, -1).sum(axis=1)


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_load_balance_evens_out_the_causal_work(shards):
  length = 64 * shards
  balanced = _causal_work(context_parallel.ContextParallel(shards, "all_gather", True), length)
  plain = _causal_work(context_parallel.ContextParallel(shards, "all_gather", False), length)
  assert balanced.max() / balanced.min() <= 1.1, balanced
  assert plain.max() / plain.min() == pytest.approx(2 * shards - 1, rel=0.05), plain
  assert balanced.sum() == plain.sum() == length * (length + 1) // 2


def test_reorder_lays_out_chunks_d_and_2n_minus_1_minus_d():
  layout = context_parallel.ContextParallel(4, "ring", True)
  order = layout.token_order(16)
  np.testing.assert_array_equal(order, [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9])
  batch = {"inputs": jnp.arange(32).reshape(2, 16)}
  reordered = context_parallel.reorder(layout, batch)["inputs"]
  np.testing.assert_array_equal(reordered[0], order)
  np.testing.assert_array_equal(reordered[1], order + 16)


@pytest.mark.parametrize(
  "args, expected",
  [
    (
      ["ici_context_parallelism=4", "max_target_length=36"],
      "max_target_length=36 must be divisible by 8: context_parallel_load_balance=true cuts the sequence into 2 x "
      "context (4) chunks (or set it to false)",
    ),
    (
      ["ici_context_parallelism=4", "max_target_length=34", "context_parallel_load_balance=false"],
      "max_target_length=34 must be divisible by 4: the sequence is split over 4 devices (sequence 1 x context 4)",
    ),
    (
      ["ici_context_parallelism=2", "ici_sequence_parallelism=2", *RING],
      "context_parallel_strategy=ring does not combine with ici/dcn_sequence_parallelism (2)",
    ),
    (
      ["ici_context_parallelism=3"],
      "ici_fsdp_parallelism=-1 cannot be filled: devices per slice 8 is not divisible by ici_context_parallelism=3",
    ),
    (
      ["ici_context_parallelism=16", "ici_fsdp_parallelism=1"],
      "ici_*_parallelism multiply to 16 (ici_context_parallelism=16) but there are 8 devices per slice",
    ),
  ],
)
def test_bad_context_parallelism_is_one_line(args, expected):
  with pytest.raises(ConfigError) as error:
    _config_for_8_devices(*args)
  assert expected in str(error.value)
  assert "\n" not in str(error.value)


def _config_for_8_devices(*args):
  """The config for 8 devices of the local CPU platform (a v5e-8 topology from libtpu: no backend needed)."""
  argv = ["test", BASE_YML, *tiny_args("compile_topology=v5e-8", "attention=dot_product", *args)]
  return pyconfig.initialize(argv, environ={}, for_compile_topology=True)


def test_ring_needs_dot_product_attention():
  values = {"max_target_length": 1024, "context_parallel_load_balance": True, "context_parallel_strategy": "ring"}
  values.update(num_query_heads=4, num_kv_heads=4, logical_axis_rules=[])
  with pytest.raises(
    ConfigError, match="context_parallel_strategy=ring runs with attention=dot_product, not attention=flash"
  ):
    attention_selection.check_length_sharding({**values, "attention": "flash"}, {"context": 4})
  attention_selection.check_length_sharding({**values, "attention": "dot_product"}, {"context": 4})


def test_flash_query_shards_must_fill_its_blocks():
  values = {"max_target_length": 1024, "context_parallel_load_balance": True, "attention": "flash"}
  values.update(num_query_heads=4, num_kv_heads=4, logical_axis_rules=[])
  with pytest.raises(ConfigError, match="over context 16 into 64 queries each: that must be a multiple of 128"):
    attention_selection.check_length_sharding({**values, "context_parallel_strategy": "all_gather"}, {"context": 16})


def test_decode_refuses_context_parallelism(tmp_path):
  args = tiny_args("ici_context_parallelism=2", "max_prefill_predict_length=8", f"base_output_directory={tmp_path}")
  result = run_python([DECODE_PY, BASE_YML, "run_name=d", 'prompt="I love"', *args], env_extra=cpu_env(8))
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1].startswith("Error: decoding does not run with context parallelism")
  assert "Traceback" not in result.stderr


def test_flash_heads_must_divide_over_sequence():
  values = {"max_target_length": 4096, "attention": "flash", "num_query_heads": 32, "num_kv_heads": 8}
  values["logical_axis_rules"] = [
    ("activation_heads", ("tensor", "sequence")),
    ("activation_kv_heads", ("tensor", "sequence")),
  ]
  with pytest.raises(ConfigError, match="splits the heads over sequence 16 = 16 ways, which num_kv_heads=8 does not divide"):
    attention_selection.check_length_sharding(values, {"sequence": 16})
  values.update(attention="dot_product", context_parallel_load_balance=True, context_parallel_strategy="all_gather")
  with pytest.raises(ConfigError, match=r"context parallelism \(2\) splits the heads over sequence 16 = 16 ways"):
    attention_selection.check_length_sharding(values, {"sequence": 16, "context": 2})


@pytest.mark.slow  # the splash kernel compiles for TPU in a minute or more on 2 cores
@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_context_parallelism_compiles_for_tpu(strategy):
  """train_compile.py's path on a v5e-8 target: all_gather with the flash (splash) kernel cut into the query shards,
  and ring (dot_product blocks passed around with collective-permutes)."""
  from MaxText.aot import aot_compile  # pylint: disable=import-outside-toplevel

  kernel = "flash" if strategy == "all_gather" else "dot_product"
  args = tiny_args("compile_topology=v5e-8", "dataset_type=synthetic", "max_target_length=1024", "per_device_batch_size=1")
  args += ["ici_context_parallelism=4", f"context_parallel_strategy={strategy}", f"attention={kernel}"]
  config = pyconfig.initialize(["test", BASE_YML, *args], environ={}, for_compile_topology=True)
  outcome = aot_compile.compile_for_target(config)
  assert outcome.fits and outcome.compiler_error == ""
  hlo = outcome.compiled.as_text()
  if strategy == "all_gather":
    assert "tpu_custom_call" in hlo  # the Mosaic kernel, not the interpreter
  else:
    assert "collective-permute" in hlo


_STEP_SHAPES = """
import json, re, sys
from MaxText import pyconfig
from MaxText.aot import aot_compile
from MaxText.tests.helpers import BASE_YML, tiny_args
found = {}
for strategy in ("ring", "all_gather"):
  args = tiny_args("compile_topology=cpu-8", "dataset_type=synthetic", "max_target_length=256", "per_device_batch_size=1")
  args += ["ici_context_parallelism=4", f"context_parallel_strategy={strategy}", "attention=dot_product"]
  config = pyconfig.initialize(["t", BASE_YML, "run_name=t", *args], environ={}, for_compile_topology=True)
  hlo = aot_compile.compile_for_target(config).compiled.as_text()
  # Arrays of head_dim 8 that span the whole 256-token sequence: queries, keys or values (or their gradients).
  found[strategy] = sorted(set(re.findall(r"\\w+\\[(?:\\d+,)*256(?:,\\d+)*,8\\]", hlo)))
print(json.dumps(found))
"""


def test_ring_never_holds_the_whole_key_value_sequence():
  """The compiled train step (8 CPU devices, context 4, 256 tokens, 64 per device): with ring no array of heads spans
  the sequence; with all_gather the gathered keys and values do (which shows the search finds them)."""
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0", "JAX_PLATFORMS": "cpu"}
  result = run_python(["-c", _STEP_SHAPES], env_extra=env)
  assert result.returncode == 0, result.stderr[-3000:]
  found = json.loads(result.stdout.strip().splitlines()[-1])
  assert found["ring"] == [], found
  assert "f32[4,256,2,8]" in found["all_gather"], found  # 4 rows of keys: 256 tokens, 2 kv heads of 8


@pytest.mark.slow  # about 3 minutes on 2 cores: a 31.7B model on 256 devices, the splash mask of 65536 tokens
def test_upstreams_long_context_aot_case_compiles_and_fits():
  """Upstream's own train_compile.py case, refused before with `attention=flash cannot shard the sequence`."""
  from MaxText.aot import aot_compile  # pylint: disable=import-outside-toplevel

  args = ["compile_topology=v5e-256", "compile_topology_num_slices=1", "use_iota_embed=true", "ici_sequence_parallelism=16"]
  args += ["global_parameter_scale=32", "per_device_batch_size=0.0625", "max_target_length=65536"]
  config = pyconfig.initialize(["test", BASE_YML, "run_name=t", *args], environ={}, for_compile_topology=True)
  assert config.attention == "flash"
  outcome = aot_compile.compile_for_target(config)
  assert outcome.fits and outcome.compiler_error == ""


def test_a_mesh_the_torus_cannot_hold_is_one_line():
  """v5p-256 is a 4x4x8 torus of 128 chips: a context axis of 64 spans parts of two physical axes."""
  from MaxText.aot import aot_compile  # pylint: disable=import-outside-toplevel
  from MaxText.errors import UserError  # pylint: disable=import-outside-toplevel

  args = tiny_args(
    "compile_topology=v5p-256", "ici_context_parallelism=64", "ici_fsdp_parallelism=2", "attention=dot_product"
  )
  args.append("max_target_length=256")
  config = pyconfig.initialize(["test", BASE_YML, "run_name=t", *args], environ={}, for_compile_topology=True)
  with pytest.raises(UserError, match="does not fit the devices' physical axes.*set allow_split_physical_axes=true"):
    aot_compile.compile_for_target(config)
