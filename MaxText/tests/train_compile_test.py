"""train_compile.py: the real train step compiled for TPU topologies from this CPU host, judged, saved and loaded.

TPU targets come from libtpu's topology descriptions (the test requirements install libtpu); `cpu-8` targets
this host's CPU platform, so compile -> save -> load in train.py -> train runs here end to end.
"""

import importlib.util
import sys

import jax
import pytest

from MaxText import pyconfig
from MaxText.aot import aot_compile
from MaxText.errors import UserError
from MaxText.runtime import aot_targets
from MaxText.tests.helpers import BASE_YML, REPO_ROOT, run_python, run_train, tiny_args

TRAIN_COMPILE_PY = f"{REPO_ROOT}/MaxText/train_compile.py"
# The tiny model, with the kernel that compiles fastest (the flash test builds the TPU kernel on purpose), unrolled.
TINY_AOT = ["attention=dot_product", "dataset_type=synthetic", "scan_layers=false"]


def aot_config(*args, **kwargs):
  """pyconfig for the tiny model on compile_topology (given in args)."""
  return pyconfig.initialize(
    ["test", BASE_YML, *tiny_args(*TINY_AOT, *args)], environ={}, for_compile_topology=True, **kwargs
  )


@pytest.fixture(scope="module", autouse=True)
def needs_libtpu():
  if importlib.util.find_spec("libtpu") is None:
    pytest.fail("libtpu is not installed; the test requirements have it: pip install -r requirements-test.txt")


@pytest.mark.parametrize("name", sorted(aot_targets.TPU_TARGETS))
def test_every_tpu_name_describes_its_devices(name):
  target = aot_targets.lookup(name)
  devices = aot_targets.devices(target, 1)
  cores_or_chips = int(name.split("-")[1])
  per_device = 2 if name.startswith(("v4", "v5p")) else 1  # a megacore device is a chip of two TensorCores
  assert len(devices) == cores_or_chips // per_device == target.devices_per_slice
  assert {d.device_kind for d in devices} == {target.chip.device_kind}


def test_unknown_topology_lists_the_valid_ones():
  with pytest.raises(UserError, match=r"compile_topology=v5e-512 is not a known target; valid: v4-8 \.\.\. v4-4096.*cpu-N"):
    aot_targets.lookup("v5e-512")


def test_missing_libtpu_says_how_to_install_it(monkeypatch):
  monkeypatch.setitem(sys.modules, "libtpu", None)  # `import libtpu` now raises ImportError
  with pytest.raises(UserError, match=r"needs libtpu.*bash setup.sh DEVICE=tpu"):
    aot_targets.devices(aot_targets.lookup("v5e-8"), 1)


def test_a3_on_a_cpu_host_is_one_line():
  try:
    with pytest.raises(UserError, match=r"compile_topology=a3 .* must run on a GPU host \(this one has cpu devices\)"):
      aot_targets.devices(aot_targets.lookup("a3"), 2)
  finally:
    jax.config.update("mock_num_gpu_processes", 0)


def test_cpu_target_needs_the_devices():
  with pytest.raises(UserError, match=r"cpu-64 .* needs 64 CPU devices but this process has 1: set XLA_FLAGS"):
    aot_targets.devices(aot_targets.lookup("cpu-64"), 1)


def test_config_comes_from_the_target_not_the_local_devices():
  config = aot_config(
    "compile_topology=v5e-256",
    "compile_topology_num_slices=2",
    "per_device_batch_size=4",
    "attention=autoselected",
    "max_target_length=128",
  )
  assert (config.num_devices, config.num_slices, config.hardware, config.attention) == (512, 2, "tpu", "flash")
  assert config.global_batch_size_to_train_on == 2048
  assert dict(zip(config.mesh_axes, config.dcn_parallelism))["data"] == 2  # dcn_data_parallelism=-1 filled by slices
  assert dict(zip(config.mesh_axes, config.ici_parallelism))["fsdp"] == 256


@pytest.fixture(scope="module")
def v5e_8_outcome():
  return aot_compile.compile_for_target(aot_config("compile_topology=v5e-8"))


@pytest.mark.parametrize("topology", ["v4-8", "v5e-8 x 2"])
def test_compiles_for_tpu_topologies(topology, v5e_8_outcome):
  name, _, slices = topology.partition(" x ")
  outcome = aot_compile.compile_for_target(
    aot_config(f"compile_topology={name}", f"compile_topology_num_slices={slices or 1}")
  )
  _check_fits(outcome)
  assert len(outcome.devices) == {"v4-8": 4, "v5e-8": 16}[name]
  assert outcome.config.num_slices == int(slices or 1)


def test_v5e_8_report(v5e_8_outcome):
  _check_fits(v5e_8_outcome)
  text = "\n".join(aot_compile.report(v5e_8_outcome))
  for line in ("Target: v5e-8 = 8 devices (TPU v5 lite), mesh fsdp=8", "  arguments ", "  temporaries ", "  generated code ",
               "  total ", " of 15.75 GiB", "TFLOPs per device", "Step time breakdown: operations ",
               "Estimate: "):  # fmt: skip
    assert line in text, text
  estimate = v5e_8_outcome.estimate  # libtpu writes its cycle estimate on (nearly) every operation it emits
  assert estimate.from_cycles > 0.9 * estimate.operations_seconds


def _check_fits(outcome):
  assert outcome.fits and outcome.compiler_error == ""
  assert 0 < outcome.memory.peak_bytes < outcome.memory_limit_bytes
  assert outcome.memory.argument_bytes > 0 and outcome.memory.temp_bytes > 0
  headroom = (outcome.memory_limit_bytes - outcome.memory.peak_bytes) / 2**30
  assert aot_compile.verdict(outcome).startswith(f"Verdict: fits, with {headroom:.2f} GiB of headroom per device")


@pytest.mark.slow  # a minute or more on 2 cores; CI runs it with -m slow
def test_flash_is_the_tpu_kernel_not_the_interpreter():
  outcome = aot_compile.compile_for_target(aot_config("compile_topology=v5e-8", "attention=flash", "max_target_length=128"))
  assert outcome.fits
  assert "tpu_custom_call" in outcome.compiled.as_text()  # a Mosaic kernel; the CPU interpreter would leave none


def test_oversized_batch_does_not_fit_and_exits_non_zero(tmp_path):
  too_big = [
    "base_emb_dim=256",
    "vocab_size=32768",
    "max_target_length=2048",
    "per_device_batch_size=64",
    "remat_policy=none",
  ]
  args = tiny_args(*TINY_AOT, "compile_topology=v5e-4", *too_big)  # float32 logits alone: 16 GiB per device
  result = run_python([TRAIN_COMPILE_PY, "MaxText/configs/base.yml", *args])
  assert result.returncode == 3, result.stderr[-3000:]
  assert "Traceback" not in result.stderr
  verdict = [line for line in result.stdout.splitlines() if line.startswith("Verdict:")]
  assert len(verdict) == 1, result.stdout
  assert "does not fit by at least" in verdict[0] and "GiB per device" in verdict[0] and "RESOURCE_EXHAUSTED" in verdict[0]


@pytest.mark.slow
def test_roofline_counts_every_scanned_layer():
  """The operations of a scanned layer count once per layer: the estimate of a scanned model equals the unrolled
  model's (XLA's own cost analysis counts a loop body once)."""
  estimates = {}
  for scan in ("true", "false"):
    not_tiny = ["base_emb_dim=256", "base_mlp_dim=1024", "head_dim=64", "max_target_length=256", "vocab_size=256"]
    config = aot_config("compile_topology=v5e-4", f"scan_layers={scan}", "base_num_decoder_layers=4", *not_tiny)
    estimates[scan] = aot_compile.compile_for_target(config).estimate
  assert estimates["true"].compiled_tflops == pytest.approx(estimates["false"].compiled_tflops, rel=0.02)
  # The probes' fusions differ a little from the whole model's: 6.7% more traffic when measured (libtpu 0.0.42).
  assert estimates["true"].compiled_gbytes == pytest.approx(estimates["false"].compiled_gbytes, rel=0.1)


@pytest.mark.slow  # a minute or more on 2 cores; CI runs it with -m slow
def test_compile_save_load_train_gives_the_plain_jit_losses(tmp_path):
  eight_devices = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  compiled_file = tmp_path / "step.pickle"
  common = ["steps=3", "enable_checkpointing=false", "learning_rate=1e-2"]  # run_train's rate: the schedule is baked in
  result = run_python(
    [
      TRAIN_COMPILE_PY,
      "MaxText/configs/base.yml",
      *tiny_args("compile_topology=cpu-8", f"compiled_trainstep_file={compiled_file}", *common),
    ],
    env_extra=eight_devices,
  )
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  assert "Verdict: fits" in result.stdout and compiled_file.exists()

  loaded, loaded_metrics = run_train(
    tmp_path, "loaded", f"compiled_trainstep_file={compiled_file}", *common, env=eight_devices
  )
  assert loaded.returncode == 0, loaded.stderr[-3000:]
  assert f"Loaded the compiled train step from {compiled_file}" in loaded.stdout
  plain, plain_metrics = run_train(tmp_path, "plain", *common, env=eight_devices)
  assert plain.returncode == 0, plain.stderr[-3000:]
  losses = [[m["learning/loss"] for m in metrics] for metrics in (loaded_metrics, plain_metrics)]
  assert len(losses[0]) == 3 and losses[0] == losses[1]

  other, _ = run_train(
    tmp_path, "other", f"compiled_trainstep_file={compiled_file}", "per_device_batch_size=4", *common, env=eight_devices
  )
  assert other.returncode == 2
  assert "Traceback" not in other.stderr
  last_line = other.stderr.strip().splitlines()[-1]
  assert last_line.startswith(f"Error: compiled_trainstep_file={compiled_file} was compiled for another run: ")
  assert "was compiled for another run: per_device_batch_size=4.0 here but 2.0 in the file;" in last_line


def test_fractional_batch_with_sequence_parallelism_compiles():
  """Long context: fewer rows than devices, each row's length sharded over the sequence axis."""
  config = aot_config(
    "compile_topology=v5e-16", "ici_sequence_parallelism=4", "per_device_batch_size=0.25", "max_target_length=256"
  )
  assert (config.global_batch_size_to_train_on, dict(zip(config.mesh_axes, config.ici_parallelism))["sequence"]) == (4, 4)
  _check_fits(aot_compile.compile_for_target(config))


@pytest.mark.slow
def test_search_finds_the_largest_batch_that_fits():
  large_logits = ["base_emb_dim=256", "vocab_size=131072", "max_target_length=2048"]  # float32 logits: 1 GiB a row
  args = tiny_args(
    *TINY_AOT, "compile_topology=v5e-1", "compile_search=per_device_batch_size", "remat_policy=none", *large_logits
  )
  result = run_python([TRAIN_COMPILE_PY, "MaxText/configs/base.yml", *args])
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  rows = [line.split() for line in result.stdout.splitlines() if line.startswith("  none ")]
  fits = {float(row[1]): row[4] == "fits" for row in rows}
  best = max(size for size, ok in fits.items() if ok)
  assert fits.get(best + 1) is False, rows  # the next size up was compiled and does not fit
  assert f"remat_policy=none: largest per_device_batch_size that fits: {best:g}" in result.stdout


def test_cpu_runs_stay_off_libtpu_on_a_host_without_tpus(tmp_path):
  """libtpu is installed here (for the targets above); a plain train.py must neither start a TPU nor log its errors."""
  result, metrics = run_train(tmp_path, "cpu", "steps=1", "enable_checkpointing=false", env={"JAX_PLATFORMS": ""})
  assert result.returncode == 0 and len(metrics) == 1, result.stderr[-2000:]
  assert "TPU" not in result.stderr and "libtpu" not in result.stderr, result.stderr[-2000:]


@pytest.mark.slow  # a minute or more on 2 cores; CI runs it with -m slow
def test_upstream_keys_that_shape_the_step_compile_for_tpu():
  """fused_qkv, fused_mlp, use_iota_embed and remat_policy=minimal_offloaded (saved activations in host memory)."""
  keys = ["fused_qkv=true", "fused_mlp=true", "use_iota_embed=true", "remat_policy=minimal_offloaded", "base_num_kv_heads=4"]
  outcome = aot_compile.compile_for_target(aot_config("compile_topology=v5e-4", *keys))
  _check_fits(outcome)
  assert outcome.host_bytes > 0  # the offloaded activations
  assert "  host memory " in "\n".join(aot_compile.report(outcome))


def test_compiled_step_file_names_what_differs_and_rejects_other_files(tmp_path):
  from MaxText.aot import compiled_step_file  # pylint: disable=import-outside-toplevel
  from MaxText.tests.helpers import tiny_config  # pylint: disable=import-outside-toplevel

  devices = jax.devices()
  compiled_for = compiled_step_file.step_signature(tiny_config(), devices)
  here = tiny_config("per_device_batch_size=4", "learning_rate=1e-3", "steps=7", "enable_checkpointing=false")
  differences = compiled_step_file._differences(compiled_for, compiled_step_file.step_signature(here, devices), here)
  assert differences[:2] == [
    "learning_rate=0.001 here but 3e-05 in the file",
    "per_device_batch_size=4.0 here but 2.0 in the file",
  ]
  assert not [d for d in differences if d.startswith(("steps=", "enable_checkpointing="))]  # outside the step
  assert "learning_rate_schedule_steps=7 here but 150001 in the file" in differences  # steps sets the baked-in schedule
  with pytest.raises(UserError, match="does not exist"):
    compiled_step_file._read(str(tmp_path / "missing.pickle"))
  (tmp_path / "garbage.pickle").write_bytes(b"garbage")
  with pytest.raises(UserError, match="is not a compiled train step of train_compile.py"):
    compiled_step_file._read(str(tmp_path / "garbage.pickle"))


def test_verdict_over_the_limit_without_a_compiler_error_says_where_it_comes_from():
  memory = aot_compile.memory_check.CompiledMemory(2 * 2**30, 0, 0, 30 * 2**30, 2**20)  # 32.00 GiB in all
  tpu = aot_compile.Outcome(None, aot_targets.lookup("v4-8"), [], 0, 0.0, int(30.75 * 2**30), memory=memory)
  assert tpu.fits  # the TPU compiler checks memory itself, and it raised nothing
  assert aot_compile.verdict(tpu) == (
    "Verdict: fits, with no headroom to spare on a TPU v4 device (30.75 GiB): the TPU compiler accepted it (it checks "
    "the program against the chip's memory), though the analysed parts add up to 32.00 GiB"
  )
  cpu = aot_compile.Outcome(None, aot_targets.lookup("cpu-8"), [], 0, 0.0, int(30.75 * 2**30), memory=memory)
  assert not cpu.fits
  assert aot_compile.verdict(cpu) == (
    "Verdict: does not fit by 1.25 GiB per device on a cpu device (30.75 GiB) (by the compiler's memory analysis; "
    "this compiler does not check memory itself)"
  )


@pytest.mark.slow  # about 25 s of compiles
def test_an_estimate_dominated_by_the_cross_slice_gradient_reduction():
  """2 x v5e-4 and a batch of one row per chip: the step is the float32 gradients' all-reduce across the slices,
  each chip sending its fsdp quarter over its 3.125 GB/s of DCN. With collectives ignored it would be the roofline."""
  dims = ["base_emb_dim=512", "base_mlp_dim=2048", "base_num_query_heads=8", "base_num_kv_heads=8", "head_dim=64"]
  config = aot_config(
    "compile_topology=v5e-4", "compile_topology_num_slices=2", *dims, "base_num_decoder_layers=2", "vocab_size=32768"
  )
  outcome = aot_compile.compile_for_target(config)
  estimate = outcome.estimate
  expected = 2 * (1 / 2) * (outcome.num_params * 4 / 4) / 3.125e9  # all-reduce over 2 slices of 1/4 of the params
  assert estimate.comm.dcn + estimate.comm.dcn_loop == pytest.approx(expected, rel=0.05)
  assert estimate.step_seconds - estimate.computation_seconds == pytest.approx(expected + estimate.comm.ici, rel=0.01)
  assert estimate.bound == "DCN" and estimate.step_seconds > 3 * estimate.computation_seconds
