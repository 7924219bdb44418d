"""Pipeline parallelism (mesh axis stage): the schedule, its config errors, and on 8 forced CPU devices the 1-device
losses for each layout, collective-permutes between the stages, and checkpoints that do not depend on the pipeline
(a pipelined checkpoint resumes on one device and on another pipeline, and decodes as the 1-device run's)."""

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.configuration import pipeline_schedule
from MaxText.errors import ConfigError
from MaxText.layers import microbatch_combine, moe, pipeline
from MaxText.tests.helpers import LORA, run_python, tiny_args, tiny_config
from MaxText.tests.tiny_models import DEEPSEEK


def _schedule(**kw):
  values = dict(stages=4, microbatches=4, repeats=2, layers_per_stage=1, pipelined_layers=8, num_layers=8)
  values.update(kw)
  return pipeline_schedule.Schedule(**values)


def test_bubble_is_the_fill_and_drain_share_of_the_iterations():
  schedule = _schedule()  # 4 stages, 4 microbatches, 2 repeats: 8 work items + 3 fill/drain iterations
  assert schedule.iterations == 11
  assert schedule.bubble == pytest.approx(3 / 11)  # (stages - 1) / (repeats x microbatches + stages - 1)
  delayed = _schedule(microbatches=8, delay=2)
  assert delayed.iterations == 16 + 6 and delayed.bubble == pytest.approx(6 / 22)
  assert "bubble 27.3% (3 of 11 iterations)" in schedule.line()
  assert schedule.line().startswith("Pipeline: 4 stages, 4 microbatches, 2 repeats, 1 layers per stage;")


def test_memory_order_gives_each_stage_its_circular_groups_then_its_share_of_the_rest():
  # Stage s holds groups s and s + 4 (repeat-major); the stage axis splits the layer axis into 4 chunks of 2.
  assert _schedule().memory_order() == (0, 4, 1, 5, 2, 6, 3, 7)
  # 2 stages, 2 layers per stage, 2 repeats over the first 8 of 12 layers; 2 of the last 4 per stage.
  order = _schedule(stages=2, layers_per_stage=2, pipelined_layers=8, num_layers=12).memory_order()
  assert order == (0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11)
  one_repeat = _schedule(stages=4, repeats=1, layers_per_stage=2)
  assert one_repeat.memory_order() == tuple(range(8)) and not one_repeat.reorders_layers


def test_split_microbatches_combine_into_the_whole_batch_statistics():
  rows = jnp.arange(12.0).reshape(6, 2)  # 6 rows of a per-row statistic
  micro = pipeline._microbatches(rows, 3)  # microbatch m holds rows m, m + 3
  np.testing.assert_array_equal(microbatch_combine.rows(micro), rows)
  stacked = {"max": jnp.array([[1.0, 5.0], [4.0, 2.0], [3.0, 3.0]])}  # 3 microbatches' values
  folded = microbatch_combine.folded(lambda a, b: jax.tree.map(jnp.maximum, a, b))(stacked)
  np.testing.assert_array_equal(folded["max"], [4.0, 5.0])
  assert microbatch_combine.combined({"layer": {moe.ROW_TOKENS: (micro[..., 0],)}})["layer"][moe.ROW_TOKENS][0].shape == (6,)
  with pytest.raises(ValueError, match="'unregistered'"):
    microbatch_combine.combined({"unregistered": (micro,)})


def test_per_use_copies_take_their_gradient_by_the_collection_rule():
  """A collection used once per microbatch (fp8's state) gets the rule's combination of its copies' gradients (the
  largest), not their sum; the bubbles' copy is dropped."""
  layers = jnp.zeros((1, 1, 2, 3))  # [stages, repeats, layers per stage, ...]
  rule = microbatch_combine.folded(jnp.maximum)

  def loss(tree):
    copies = pipeline._per_use(tree, 2, rule)  # [1, 1, 2, 3 (2 microbatches + the bubbles'), 3]
    return jnp.sum(copies * jnp.array([1.0, 3.0, 100.0])[:, None])  # the bubbles' copy: 100

  np.testing.assert_array_equal(jax.grad(loss)(layers), jnp.full((1, 1, 2, 3), 3.0))


# 8 devices as pyconfig sees them (the checks run before JAX builds a mesh).
CPUS = [types.SimpleNamespace(platform="cpu", id=i, slice_index=0, process_index=0) for i in range(8)]


def _config(*args):
  return tiny_config("base_num_decoder_layers=8", "per_device_batch_size=1", *args, devices=CPUS)


@pytest.mark.parametrize(
  "args,message",
  [
    (["ici_pipeline_parallelism=4", "num_layers_per_pipeline_stage=3"], "8 pipelined layers do not split into 4 stages"),
    (["ici_pipeline_parallelism=2", "num_pipeline_microbatches=3"], "num_pipeline_microbatches=3 must be a multiple"),
    (["ici_pipeline_parallelism=2", "num_pipeline_microbatches=16"], "does not divide the 8 rows"),
    (["ici_pipeline_parallelism=2", "pipeline_parallel_layers=10"], "pipeline_parallel_layers=10 is more than"),
    (
      [
        "ici_pipeline_parallelism=2",
        "eval_interval=5",
        "per_device_batch_size=8",
        "eval_per_device_batch_size=1",
        "num_pipeline_microbatches=16",
      ],
      "the 8 eval rows do not split into num_pipeline_microbatches=16",
    ),
    (
      ["ici_pipeline_parallelism=2", "pipeline_delay_activation_forwarding=true", "num_pipeline_microbatches=2"],
      "at least 2 x stages = 4",
    ),
    (["ici_pipeline_parallelism=2", "num_pipeline_microbatches=8"], "8 rows do not split into num_pipeline_microbatches=8"),
  ],
)
def test_bad_pipeline_configs_get_one_line_before_any_compile(args, message):
  with pytest.raises(ConfigError, match=message):
    _config(*args)


def test_gemma2s_pipeline_keys_count_its_layer_pairs():
  schedule = pipeline_schedule.resolve(_config("ici_pipeline_parallelism=2", "decoder_block=gemma2").get_keys())
  assert (schedule.num_layers, schedule.repeats, schedule.block_layers) == (4, 2, 2)  # 8 layers: 4 pairs
  assert "1 blocks of 2 layers per stage" in schedule.line()
  with pytest.raises(ConfigError, match="3 pipelined blocks of 2 layers do not split into 2 stages"):
    _config("ici_pipeline_parallelism=2", "decoder_block=gemma2", "base_num_decoder_layers=6")


def test_the_config_resolves_repeats_and_microbatches():
  config = _config("ici_pipeline_parallelism=4")
  assert (config.num_pipeline_repeats, config.num_pipeline_microbatches) == (2, 4)
  delayed = _config("ici_pipeline_parallelism=2", "pipeline_delay_activation_forwarding=true", "per_device_batch_size=2")
  assert delayed.num_pipeline_microbatches == 4


# ---- 8 forced CPU devices: one child process runs every layout (MaxText/tests/sharded_runs.py) ----

STEPS = 4
LAYERS = ["base_num_decoder_layers=8", f"learning_rate_schedule_steps={STEPS}"]
# name -> parallelism; each trains 16 rows of 8 layers as the 1-device run does.
LAYOUTS = {
  "stage4_fsdp2": ["ici_pipeline_parallelism=4", "ici_fsdp_parallelism=2"],  # 2 repeats, 4 microbatches
  "stage2_tensor2_data2": [
    "ici_pipeline_parallelism=2",
    "ici_tensor_parallelism=2",
    "ici_data_parallelism=2",
    "ici_fsdp_parallelism=1",
    "num_layers_per_pipeline_stage=2",
    "num_pipeline_repeats=2",
    "num_pipeline_microbatches=8",
  ],
  "stage2_half_pipelined": ["ici_pipeline_parallelism=2", "pipeline_parallel_layers=4"],
  "stage2_sequence2_expert2": [
    "ici_pipeline_parallelism=2",
    "ici_sequence_parallelism=2",
    "ici_expert_parallelism=2",
    "ici_fsdp_parallelism=1",
    "attention=dot_product",
  ],
  # Context parallelism inside the stages: ring attention over the sequence's load-balanced chunks.
  "stage2_context2_fsdp2": [
    "ici_pipeline_parallelism=2",
    "ici_context_parallelism=2",
    "ici_fsdp_parallelism=2",
    "context_parallel_strategy=ring",
  ],
  "stage2_delayed_unscanned_ag_once": [
    "ici_pipeline_parallelism=2",
    "ici_data_parallelism=2",
    "pipeline_delay_activation_forwarding=true",
    "scan_pipeline_iterations=false",
    "pipeline_fsdp_ag_once=true",
  ],
}
ACCUMULATION = ["gradient_accumulation_steps=2"]
# Gemma 3's local and global layers: each stage's layers are told their index in the model.
GEMMA3 = ["decoder_block=gemma3", "sliding_window_size=8"]
# Gemma 2's blocks are (local, global) layer pairs: the pipeline keys count blocks (8 layers: 2 stages x 2 blocks).
GEMMA2 = ["decoder_block=gemma2", "sliding_window_size=8"]
DECODE = ["max_target_length=24", "max_prefill_predict_length=8", "dataset_type=synthetic"]
# Model collections through the pipeline: fp8's state (a copy per microbatch, combined by maximum), the MoE routing
# statistics (sown per row, put back in row order); each with layers after the pipeline and layers reordered.
FP8 = ["quantization=fp8"]
# 2 steps: fp8's casts (3 and 2 mantissa bits) turn the last-bit differences of another layout's sums into whole
# steps of the fp8 grid, and Adam's first update turns those of near-zero gradients into whole steps too: from step
# 2 the losses differ by about 3e-4 here, as every multi-device fp8 run's do, and step 1's amaxes by up to 20%.
# Step 0's amax (the oldest entry of each history) and the scales made from it equal 1 device's.
FP8_STEPS = 2
MOE = ["decoder_block=mixtral", "num_experts=4", "num_experts_per_tok=2"]
# QLoRA with int8 codes: the frozen codes and the adapters go round the stages (it used to hang at the end of the run).
QLORA_INT8 = [*LORA, "lora_weight_qtype=int8"]
# DeepSeek: 2 dense layers run before the pipeline, its 4 MoE layers go round 2 stages twice (reordered in memory).
DEEPSEEK_STACKS = [*DEEPSEEK, "base_num_decoder_layers=6", "first_num_dense_layers=2"]
# Dropout: a layer's masks come from its index and each microbatch takes its rows of the whole batch's mask, so the
# pipeline (microbatches, repeats reordered in memory, layers after it) draws 1 device's masks.
DROPOUT = ["dropout_rate=0.3"]
# Unrolled layers (scan_layers=false) are stacked for the pipeline at every step; LoRA's adapters train in them and
# each layer's MoE routing statistics go back under its own name.
UNSCANNED = ["scan_layers=false", *MOE, *LORA]


def _runs(tmp_path) -> list[dict]:
  def run(name, devices, *args, steps=STEPS, checkpoints=False, decode=False):
    rows = "per_device_batch_size=16" if devices == 1 else "per_device_batch_size=2"
    common = [f"base_output_directory={tmp_path}", rows, *LAYERS, f"run_name={name}"]
    if not decode:
      common += [f"steps={steps}", "learning_rate=1e-2", f"metrics_file={tmp_path / name}.jsonl"]
      common += ["checkpoint_period=2", "save_checkpoint_on_completion=false"] if checkpoints else []
      common += [] if checkpoints else ["enable_checkpointing=false"]
    return {"name": name, "devices": devices, "args": tiny_args(*common, *args), "decode": decode, "probes": []}

  checkpoint_items = tmp_path / "pipelined" / "checkpoints" / "2" / "items"
  return [
    run("one", 1, checkpoints=True),
    *(run(name, 8, *args) for name, args in LAYOUTS.items()),
    run("one_accumulating", 1, *ACCUMULATION),
    run("gemma3_one", 1, *GEMMA3),
    run("gemma3_stage4_fsdp2", 8, *GEMMA3, *LAYOUTS["stage4_fsdp2"]),
    run("gemma2_one", 1, *GEMMA2),
    run("gemma2_stage2", 8, *GEMMA2, "ici_pipeline_parallelism=2"),
    run("stage2_accumulating", 8, "ici_pipeline_parallelism=2", *ACCUMULATION),
    # Saved at step 2 by a 4-stage pipeline (2 repeats: the layers reordered in memory), then resumed by one device
    # and by a 2-stage pipeline of 2 repeats of 2 layers (another order), each training step 3.
    run("pipelined", 8, *LAYOUTS["stage4_fsdp2"], steps=3, checkpoints=True),
    {**run("pipelined", 1, checkpoints=True), "metrics_as": "resumed_one"},
    {**run("pipelined", 8, *LAYOUTS["stage2_tensor2_data2"], checkpoints=True), "metrics_as": "resumed_stage2"},
    run("fp8_one", 1, *FP8, steps=FP8_STEPS),
    run("fp8_half_pipelined", 8, *FP8, *LAYOUTS["stage2_half_pipelined"], steps=FP8_STEPS),
    # fp8 state saved at step 0 in a 4-stage pipeline's memory order, resumed by one device (the model's order)
    run("fp8_pipelined", 8, *FP8, *LAYOUTS["stage4_fsdp2"], "checkpoint_period=1", steps=1, checkpoints=True),
    {**run("fp8_pipelined", 1, *FP8, "checkpoint_period=1", steps=FP8_STEPS, checkpoints=True), "metrics_as": "fp8_resumed"},
    run("moe_one", 1, *MOE),
    run("moe_half_pipelined", 8, *MOE, *LAYOUTS["stage2_half_pipelined"]),
    run("qlora_int8_one", 1, *QLORA_INT8),
    run("qlora_int8_stage4_fsdp2", 8, *QLORA_INT8, *LAYOUTS["stage4_fsdp2"]),
    run("deepseek_one", 1, *DEEPSEEK_STACKS),
    run("deepseek_stage2", 8, *DEEPSEEK_STACKS, "ici_pipeline_parallelism=2", "num_layers_per_pipeline_stage=1"),
    run("dropout_one", 1, *DROPOUT),
    run("dropout_stage4_fsdp2", 8, *DROPOUT, *LAYOUTS["stage4_fsdp2"]),
    run("dropout_half_pipelined", 8, *DROPOUT, *LAYOUTS["stage2_half_pipelined"]),
    run("unscanned_one", 1, *UNSCANNED),
    run("unscanned_stage4_fsdp2", 8, *UNSCANNED, *LAYOUTS["stage4_fsdp2"]),
    run("decode_pipelined", 1, *DECODE, f"load_parameters_path={checkpoint_items}", decode=True),
    run("decode_one", 1, *DECODE, f"load_parameters_path={tmp_path / 'one' / 'checkpoints' / '2' / 'items'}", decode=True),
  ]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  tmp_path = tmp_path_factory.mktemp("pipeline")
  runs = _runs(tmp_path)
  for run in runs:  # a resumed run writes its own metrics file
    if "metrics_as" in run:
      run["args"] = tiny_args(*run["args"], f"metrics_file={tmp_path / run.pop('metrics_as')}.jsonl")
  runs_path, report_path = tmp_path / "runs.json", tmp_path / "report.json"
  runs_path.write_text(json.dumps(runs))
  xla_flags = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
  env = {"XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu"}
  result = run_python(["-m", "MaxText.tests.sharded_runs", str(runs_path), str(report_path)], env_extra=env)
  assert result.returncode == 0, result.stderr[-5000:]
  out = json.loads(report_path.read_text())
  out["log"] = result.stdout + result.stderr
  out["metrics"] = {p.stem: _losses(p) for p in tmp_path.glob("*.jsonl")}
  return out


def _losses(path) -> dict[int, float]:
  return {m["step"]: m["learning/loss"] for m in map(json.loads, path.read_text().splitlines())}


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_each_pipeline_layout_trains_as_one_device(report, name):
  losses, baseline = report["metrics"][name], report["metrics"]["one"]
  assert sorted(losses) == list(range(STEPS))
  np.testing.assert_allclose([losses[s] for s in range(STEPS)], [baseline[s] for s in range(STEPS)], rtol=1e-5)
  assert report[name]["mesh"]["stage"] == int(LAYOUTS[name][0].split("=")[1])


@pytest.mark.slow
@pytest.mark.parametrize(
  "name,baseline",
  [("stage2_accumulating", "one_accumulating"), ("gemma3_stage4_fsdp2", "gemma3_one"), ("gemma2_stage2", "gemma2_one")],
)
def test_accumulation_and_layer_indices_train_as_one_device(report, name, baseline):
  losses, expected = report["metrics"][name], report["metrics"][baseline]
  np.testing.assert_allclose([losses[s] for s in range(STEPS)], [expected[s] for s in range(STEPS)], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
  "name,baseline",
  [
    ("moe_half_pipelined", "moe_one"),
    ("deepseek_stage2", "deepseek_one"),
    ("qlora_int8_stage4_fsdp2", "qlora_int8_one"),
    ("unscanned_stage4_fsdp2", "unscanned_one"),
  ],
)
def test_moe_families_and_qlora_pipeline_as_on_one_device(report, name, baseline):
  """The routing statistics go through the pipeline; DeepSeek's dense stack runs before it, its MoE stack in it;
  QLoRA's int8 codes stay frozen and its adapters train; unrolled layers pipeline as the scanned stack does."""
  losses, expected = report["metrics"][name], report["metrics"][baseline]
  np.testing.assert_allclose([losses[s] for s in range(STEPS)], [expected[s] for s in range(STEPS)], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dropout_stage4_fsdp2", "dropout_half_pipelined"])
def test_dropout_draws_one_devices_masks_in_the_pipeline(report, name):
  losses, expected, without = (report["metrics"][n] for n in (name, "dropout_one", "one"))
  np.testing.assert_allclose([losses[s] for s in range(STEPS)], [expected[s] for s in range(STEPS)], rtol=1e-5)
  assert abs(expected[0] - without[0]) > 1e-2  # dropout acts


def _assert_fp8_state_equal(ours: dict, expected: dict) -> None:
  assert ours.keys() == expected.keys() and len(expected) > 0
  for key, value in expected.items():
    np.testing.assert_allclose(ours[key], value, rtol=1e-5, err_msg=key)


@pytest.mark.slow
def test_the_fp8_state_goes_through_the_pipeline_as_on_one_device(report):
  losses, expected = report["metrics"]["fp8_half_pipelined"], report["metrics"]["fp8_one"]
  np.testing.assert_allclose([losses[0], losses[1]], [expected[0], expected[1]], rtol=1e-5)
  _assert_fp8_state_equal(report["fp8_half_pipelined"]["fp8_meta"], report["fp8_one"]["fp8_meta"])


@pytest.mark.slow
def test_a_pipelined_fp8_state_resumes_on_one_device(report):
  losses = report["metrics"]["fp8_resumed"]
  assert sorted(losses) == [1]
  np.testing.assert_allclose(losses[1], report["metrics"]["fp8_one"][1], rtol=1e-5)
  _assert_fp8_state_equal(report["fp8_pipelined"]["fp8_meta"], report["fp8_one"]["fp8_meta"])  # the resumed run's


@pytest.mark.slow
def test_the_schedule_line_is_logged_at_start(report):
  assert "Pipeline: 4 stages, 4 microbatches, 2 repeats, 1 layers per stage; bubble 27.3% (3 of 11" in report["log"]
  assert "the last 4 layers run after it with stage as data parallelism" in report["log"]


@pytest.mark.slow
def test_a_pipelined_checkpoint_resumes_on_one_device_and_on_another_pipeline(report):
  baseline = report["metrics"]["one"]
  assert sorted(report["metrics"]["pipelined"]) == [0, 1, 2]
  for resumed in ("resumed_one", "resumed_stage2"):
    losses = report["metrics"][resumed]
    assert sorted(losses) == [3], resumed  # restored step 2's checkpoint, then trained step 3
    np.testing.assert_allclose(losses[3], baseline[3], rtol=1e-5, err_msg=resumed)


@pytest.mark.slow
def test_a_pipelined_checkpoint_decodes_as_the_one_device_run(report):
  assert report["decode_pipelined"]["tokens"] == report["decode_one"]["tokens"]


COMPILE = """
import jax
from MaxText.aot import aot_compile
from MaxText.runtime import mesh
from MaxText.training import training_setup
from MaxText.tests.helpers import tiny_config
config = tiny_config({args})
device_mesh = mesh.create_device_mesh(config)
setup = training_setup.build(config, device_mesh)
text = aot_compile.lower_train_step(setup, config, device_mesh).compile().as_text()
print("collective-permutes:", text.count("collective-permute-start") + text.count(" collective-permute("))
"""


@pytest.mark.slow
def test_the_compiled_step_moves_activations_between_stages_with_collective_permutes():
  def permutes(*args):
    code = COMPILE.format(args=", ".join(repr(a) for a in ("base_num_decoder_layers=8", "per_device_batch_size=1", *args)))
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    result = run_python(["-c", code], env_extra=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return int(result.stdout.split("collective-permutes:")[1])

  assert permutes("ici_pipeline_parallelism=4", "ici_fsdp_parallelism=2") > 0
  assert permutes("ici_fsdp_parallelism=8") == 0  # none without the pipeline


@pytest.mark.slow
def test_train_compile_compiles_a_pipeline_across_slices_for_tpu():
  args = ["base_num_decoder_layers=4", "base_emb_dim=256", "base_mlp_dim=512", "head_dim=64", "dataset_type=synthetic"]
  target = ["compile_topology=v5e-8", "compile_topology_num_slices=2", "dcn_pipeline_parallelism=2"]
  result = run_python(["MaxText/train_compile.py", "MaxText/configs/base.yml", *args, *target, "per_device_batch_size=1"])
  out = result.stdout + result.stderr
  assert result.returncode == 0, out[-3000:]
  assert "Pipeline: 2 stages, 2 microbatches, 2 repeats, 1 layers per stage; bubble 20.0%" in out
  assert "mesh stage=2 (2 across slices)" in out and "Verdict: fits" in out
