"""Train-step throughput of a 1.07B-matmul-parameter llama-style model on one GPU, in several variants, one command:

    python3 benchmarks/gpu_benchmark.py                   # on a GPU host: the variant table, within ~8 minutes
    python3 benchmarks/gpu_benchmark.py --cpu-smoke       # a tiny model on CPU: the same path in seconds (CI)
    python3 benchmarks/gpu_benchmark.py --only 8x4096-unrolled-minimal_flash xla_flags_preset=a3mega
    python3 benchmarks/gpu_benchmark.py --xla-flags-ablation a3mega --budget 1800   # which of its flags help

The model: emb 2048, 16 layers, mlp 8192, 16 query / 8 kv heads of 128, vocab 32000, bfloat16 activations,
float32 weights, AdamW; the seed's GPU settings (attention=autoselected: cuDNN flash attention on a GPU,
use_iota_embed=true, logits_dot_in_fp32=false). Each variant (batch x sequence, scanned or unrolled layers,
remat policy) runs in its own process through benchmarks/train_step_benchmark.py, i.e. train.py's config,
model, sharding, compiled train step and synthetic input pipeline (reuse_example_batch=1): --warmup steps,
then the median of --steps steps. Key=value arguments are added to every variant (they win over the model's keys;
the keys that make a variant, per_device_batch_size, max_target_length, scan_layers and remat_policy, are refused:
pick variants with --only). They are checked once, before any variant starts, as pyconfig checks a config before it
looks up devices.

Prints a table: step time, host time per step (Python + dispatch, and its share of the step), tokens/s,
TFLOP/s/device (6·N·tokens + causal attention, as train.py logs), MFU (against the device's peak bf16
TFLOP/s), the device's peak memory (n/a where JAX reports none, e.g. CPU) and whether a timed step compiled.
Variants run in order until --budget seconds are spent; the rest are listed as skipped. Exit status 0; 1 when a
variant failed (its row says why; one stopped by the budget too) or a timed step compiled; 2 for a wrong argument,
or when JAX finds no GPU on this host (--cpu-smoke runs the tiny model there). SIGTERM or Ctrl-C ends the running
variant's process too (it runs in its own process group), then this one (exit status 128 + the signal's number).
--xla-flags-ablation PRESET measures a preset of MaxText/runtime/xla_flag_presets.py on the first variant: with XLA_FLAGS
as given, with the whole preset, and with each of its flags alone (a row each), so that a recommended preset holds
only flags measured to help.

Besides JAX with CUDA, flax, optax, orbax and their dependencies, the benchmark imports only what
REQUIRED_MODULES lists; it checks them first and names any that is missing (docs/performance.md).
"""

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

# pylint: disable=wrong-import-position  # (none of these imports jax)
from MaxText import pyconfig  # noqa: E402
from MaxText.configuration import config_loader, config_validation  # noqa: E402
from MaxText.errors import UserError  # noqa: E402
from MaxText.runtime import cli_args  # noqa: E402
from MaxText.runtime.xla_flag_presets import PRESETS, merged_flags  # noqa: E402

# pylint: enable=wrong-import-position

STEP_BENCHMARK = os.path.join(REPO_ROOT, "benchmarks", "train_step_benchmark.py")
BASE_YML = os.path.join(REPO_ROOT, "MaxText", "configs", "base.yml")

# Imported at benchmark time beyond jax (CUDA), flax, optax, orbax, tensorstore, sentencepiece, tiktoken and their
# dependencies: module -> pip package. (grain, google-crc32c and the tfds/hf sources load only for their datasets.)
REQUIRED_MODULES = {}  # none: measured with python3 -X importtime on the --cpu-smoke path
# The modules of the benchmarked step: importing them here finds any other missing module before a variant starts.
STEP_MODULES = (
  "MaxText.pyconfig",
  "MaxText.training.train_state",
  "MaxText.training.train_step",
  "MaxText.input_pipeline.input_pipeline_interface",
)

MODEL = [
  "base_emb_dim=2048",
  "base_num_decoder_layers=16",
  "base_mlp_dim=8192",
  "base_num_query_heads=16",
  "base_num_kv_heads=8",
  "head_dim=128",
  "vocab_size=32000",
  "dtype=bfloat16",
  "weight_dtype=float32",
]
SMOKE_MODEL = [
  "base_emb_dim=64",
  "base_num_decoder_layers=2",
  "base_mlp_dim=128",
  "base_num_query_heads=4",
  "base_num_kv_heads=2",
  "head_dim=16",
  "vocab_size=512",
  "dtype=bfloat16",
  "weight_dtype=float32",
]
COMMON = [
  "dataset_type=synthetic",
  "reuse_example_batch=1",
  "enable_checkpointing=false",
  "attention=autoselected",
  "use_iota_embed=true",
  "logits_dot_in_fp32=false",
]

# The upstream MaxText figures for this model on one H100 (the reference), for the closing line.
UPSTREAM_REFERENCE = "upstream MaxText, same model, one H100: 44.8% MFU at 4x4096 scanned; best 51.0% (8x4096, unrolled)"


@dataclasses.dataclass(frozen=True)
class Variant:
  batch: int
  length: int
  scan: bool
  remat: str

  @property
  def name(self) -> str:
    return f"{self.batch}x{self.length}-{'scanned' if self.scan else 'unrolled'}-{self.remat}"

  def args(self) -> list[str]:
    return [
      f"per_device_batch_size={self.batch}",
      f"max_target_length={self.length}",
      f"scan_layers={str(self.scan).lower()}",
      f"remat_policy={self.remat}",
    ]


# Most informative first: a time budget cuts the end of the list.
VARIANTS = (
  Variant(8, 4096, False, "minimal_flash"),
  Variant(4, 4096, True, "minimal_flash"),
  Variant(4, 4096, False, "minimal_flash"),
  Variant(8, 2048, False, "minimal_flash"),
  Variant(8, 4096, False, "save_dot_with_context_except_mlp"),
  Variant(8, 4096, True, "minimal_flash"),
)
SMOKE_VARIANTS = (Variant(2, 64, True, "minimal_flash"), Variant(2, 64, False, "save_dot_with_context_except_mlp"))
VARIANT_KEYS = tuple(arg.split("=", 1)[0] for arg in VARIANTS[0].args())
# What train_step_benchmark.py gives pyconfig.initialize besides the command line.
STEP_BENCHMARK_KWARGS = {"run_name": "benchmark", "enable_tensorboard": False}


def missing_modules() -> list[str]:
  """The pip packages of REQUIRED_MODULES, and any other module the step imports, that this Python lacks."""
  missing = [package for module, package in REQUIRED_MODULES.items() if importlib.util.find_spec(module) is None]
  if missing:
    return missing
  for module in STEP_MODULES:
    try:
      importlib.import_module(module)  # no JAX backend starts: the variants' processes own the GPU
    except ModuleNotFoundError as e:
      return [e.name]
  return []


class Stopped(Exception):
  """SIGTERM or SIGINT arrived: raised in the main thread by the signal handler, so that `finally` blocks end the
  variant's process before this one exits."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


def _raise_stopped(signum, frame):  # pylint: disable=unused-argument
  for s in (signal.SIGTERM, signal.SIGINT):  # a second signal must not interrupt the clean-up of the first
    signal.signal(s, signal.SIG_IGN)
  raise Stopped(signum)


def run_in_own_group(command: list[str], env, timeout: float | None) -> subprocess.CompletedProcess:
  """Runs a command in its own session (process group), and kills that group whatever ends the wait (the timeout,
  or Stopped from a signal): a variant's process, which holds most of the GPU's memory, never outlives this one.
  A Ctrl-C in the terminal reaches only this process, which ends the group.

  Raises subprocess.TimeoutExpired after `timeout` seconds (the group killed).
  """
  process = None
  try:
    process = subprocess.Popen(
      command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    stdout, stderr = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
  finally:
    if process is not None and process.returncode is None:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
      process.wait()


def variant_keys(variant: Variant, model: list[str], extra: list[str]) -> dict[str, str]:
  """The config keys of one variant's process: the model's, COMMON's, the variant's, then the user's (the last of a
  key wins)."""
  return dict(arg.split("=", 1) for arg in [*model, *COMMON, *variant.args(), *extra])


def run_variant(variant: Variant, model: list[str], extra: list[str], steps: int, warmup: int, timeout: float, env) -> dict:
  """One variant in its own process (its own peak memory, and an out-of-memory ends only that one)."""
  command = [sys.executable, STEP_BENCHMARK, BASE_YML, *(f"{k}={v}" for k, v in variant_keys(variant, model, extra).items())]
  command += ["--steps", str(steps), "--warmup", str(warmup), "--json"]
  try:
    result = run_in_own_group(command, env, timeout)
  except subprocess.TimeoutExpired:
    return {"error": f"stopped after {timeout:.0f} s (the time budget)"}
  lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
  if result.returncode == 0 and lines:
    return json.loads(lines[-1])
  tail = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
  return {"error": f"exit {result.returncode}: {tail[:200]}"}


# Asked in a fresh process, so that this one holds no GPU memory (libtpu, if installed, kept off a host without TPUs).
_BACKEND_PROBE = (
  f"import sys; sys.path.insert(0, {REPO_ROOT!r}); from MaxText.runtime import jax_runtime; "
  "jax_runtime.skip_absent_tpu('auto'); "
  "import jax; print(jax.default_backend())"
)


def jax_backend(env) -> str | None:
  """JAX's default backend (gpu, cpu, tpu) in a process with this environment; None if none could start."""
  try:
    result = run_in_own_group([sys.executable, "-c", _BACKEND_PROBE], {**env, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, 300)
  except subprocess.TimeoutExpired:
    return None
  lines = result.stdout.split()
  return lines[-1] if result.returncode == 0 and lines else None


def exit_status(results: dict) -> int:
  """0 when every variant that started gave a row of figures and compiled nothing while timed, else 1."""
  failed = [r for r in results.values() if "error" in r or r["compiles_while_timed"]]
  return 1 if failed or not results else 0


def _memory(num_bytes) -> str:
  return "n/a" if num_bytes is None else f"{num_bytes / 2**30:.1f} GiB"


def format_row(name: str, r: dict, width: int = 50) -> str:
  if "error" in r:
    return f"{name:<{width}} {r['error']}"
  step, host = r["step_seconds"], r["host_seconds"]
  mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "n/a"
  compiled = "yes" if r["compiles_while_timed"] else "no"
  return (
    f"{name:<{width}} {step:>8.4f} {1e3 * host:>8.2f} {100 * host / step:>5.1f}% {r['tokens_per_sec_per_device']:>11.0f} "
    f"{r['tflops_per_sec_per_device']:>9.4g} {mfu:>6} {_memory(r['peak_memory_bytes']):>9} {compiled:>8}"
  )


def header(width: int = 50, what: str = "variant (batch x seq, layers, remat)") -> str:
  return (
    f"{what:<{width}} {'step s':>8} {'host ms':>8} {'host':>6} {'tokens/s':>11} "
    f"{'TFLOP/s':>9} {'MFU':>6} {'peak mem':>9} {'compiled':>8}"
  )


def flag_ablation_runs(preset: str, user_flags: str) -> list[tuple[str, str]]:
  """(row name, XLA_FLAGS) of a preset's measurement: the user's flags alone, with the whole preset, and with
  each of its flags alone (a flag the user set keeps the user's value, as xla_flags_preset does)."""
  runs = [("XLA_FLAGS as given", user_flags), (f"+ all of {preset}", merged_flags(user_flags, PRESETS[preset])[0])]
  for flag in PRESETS[preset]:
    flags, added = merged_flags(user_flags, [flag])
    if added:
      runs.append((f"+ {flag.lstrip('-')}", flags))
  return runs


@dataclasses.dataclass
class Plan:
  """What a command line asks for, checked: the runs (row name, variant, environment) and their settings."""

  cpu_smoke: bool
  model: list[str]
  runs: list[tuple[str, Variant, dict]]
  extra: list[str]
  steps: int
  warmup: int
  budget: float
  ablation: str | None


def check_extra_keys(runs, model: list[str], extra: list[str]) -> dict:
  """The first run's config values, after checking the user's key=value arguments in each run's config as
  pyconfig.initialize checks a config before it looks up devices: no JAX backend starts, and a mistake is one line
  (a UserError; a ConfigError names the key and the value) instead of a failed row per variant."""
  given = config_loader.parse_cli(extra)  # key=value form, and no key twice
  environ = runs[0][2]
  fixed = [f"{key}={value}" for key, value in given.items() if key in VARIANT_KEYS]
  fixed += [
    f"{name}={environ[name]}" for name in (f"{config_loader.ENV_PREFIX}{k.upper()}" for k in VARIANT_KEYS) if name in environ
  ]
  if fixed:
    raise UserError(
      f"{fixed[0]}: each variant sets {', '.join(VARIANT_KEYS)} (its row name says how); "
      "pick variants with --only NAME instead"
    )
  first = None
  for _, variant, env in runs:
    argv = [STEP_BENCHMARK, BASE_YML, *(f"{k}={v}" for k, v in variant_keys(variant, model, extra).items())]
    if first is None:  # files that keys name (e.g. numerics_debug_config) are read here; any warning prints once
      first = pyconfig.load_static(argv, dict(env), **STEP_BENCHMARK_KWARGS)[0]
    else:
      config_validation.validate_static(config_loader.load_raw_config(argv, env, STEP_BENCHMARK_KWARGS)[0])
  return first


def plan(argv: list[str]) -> Plan:
  """Parses and checks a command line; raises UserError (one line) for a mistake."""
  parser = cli_args.OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--cpu-smoke", action="store_true", help="a tiny model on the CPU, two variants, few steps")
  parser.add_argument(
    "--steps", type=cli_args.int_at_least(1), default=None, help="timed steps per variant (default 10; smoke 3)"
  )
  parser.add_argument(
    "--warmup", type=cli_args.int_at_least(0), default=None, help="untimed steps first (default 3; smoke 1)"
  )
  parser.add_argument(
    "--budget",
    type=cli_args.positive_number("number of seconds"),
    default=450.0,
    help="seconds for all variants (default 450)",
  )
  parser.add_argument("--only", action="append", default=[], help="run only this variant (a name from the table)")
  parser.add_argument(
    "--xla-flags-ablation",
    choices=sorted(PRESETS),
    help="measure a flag preset on the first variant: without it, with it, and with each of its flags alone",
  )
  args, extra = parser.parse_known_args(argv[1:])
  not_keys = [arg for arg in extra if "=" not in arg or arg.startswith("-")]
  if not_keys:
    raise UserError(f"{not_keys[0]} is neither an option of this script nor a config key=value")
  missing = missing_modules()
  if missing:
    raise UserError(f"this Python lacks {', '.join(missing)}: carry the wheels (docs/performance.md)")
  env = dict(os.environ)
  if args.cpu_smoke:
    model, variants, steps, warmup = SMOKE_MODEL, SMOKE_VARIANTS, 3, 1
    env["JAX_PLATFORMS"] = "cpu"
  else:
    model, variants, steps, warmup = MODEL, VARIANTS, 10, 3
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # JAX takes 75% by default; 8x4096 wants more
  steps = steps if args.steps is None else args.steps
  warmup = warmup if args.warmup is None else args.warmup
  if args.only:
    unknown = sorted(set(args.only) - {v.name for v in variants})
    if unknown:
      raise UserError(f"--only {unknown[0]} is not a variant; variants: {', '.join(v.name for v in variants)}")
    variants = [v for v in variants if v.name in args.only]
  runs = [(v.name, v, env) for v in variants]  # (row name, variant, environment)
  if args.xla_flags_ablation:
    user_flags = env.get("XLA_FLAGS", "")
    runs = [
      (name, variants[0], {**env, "XLA_FLAGS": f}) for name, f in flag_ablation_runs(args.xla_flags_ablation, user_flags)
    ]
  preset = check_extra_keys(runs, model, extra)["xla_flags_preset"]
  if args.xla_flags_ablation and preset:
    raise UserError(
      f"--xla-flags-ablation {args.xla_flags_ablation} measures a preset flag by flag; xla_flags_preset={preset} "
      "would add a whole preset to every row: leave it out"
    )
  if not args.cpu_smoke:
    backend = jax_backend(env)
    if backend not in ("gpu", None):  # None: JAX could not start; the variants' rows say why
      raise UserError(
        f"JAX finds no GPU on this host (its backend is {backend}); the benchmark's 1.07B model needs one: "
        "--cpu-smoke runs the tiny model on the CPU"
      )
  return Plan(args.cpu_smoke, model, runs, extra, steps, warmup, args.budget, args.xla_flags_ablation)


def run(p: Plan) -> int:
  """Runs the plan's variants within its budget, printing the table; returns the exit status."""
  width = max(50, *(len(name) for name, _, _ in p.runs))
  start = time.perf_counter()
  print(
    f"{'CPU smoke (tiny model, not a GPU figure)' if p.cpu_smoke else 'GPU benchmark'}: median of {p.steps} steps "
    f"after {p.warmup} warm-up, {' '.join(p.extra) or 'no extra keys'}",
    flush=True,
  )
  print(header(width, f"{p.runs[0][1].name} with XLA flags") if p.ablation else header(width), flush=True)
  results, device = {}, None
  for name, variant, run_env in p.runs:
    left = p.budget - (time.perf_counter() - start)
    if left <= 0:
      print(f"{name:<{width}} skipped (--budget {p.budget:.0f} s spent)", flush=True)
      continue
    results[name] = r = run_variant(variant, p.model, p.extra, p.steps, p.warmup, left, run_env)
    device = device or (f"{r['device_count']} x {r['device_kind']}" if "device_kind" in r else None)
    print(format_row(name, r, width), flush=True)
  print(f"Device: {device or 'unknown'}; {time.perf_counter() - start:.0f} s in all.")
  if not p.cpu_smoke:
    print(f"Reference: {UPSTREAM_REFERENCE}, 69.8k tokens/s.")
  return exit_status(results)


def main(argv) -> int:
  handlers = {s: signal.signal(s, _raise_stopped) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    return run(plan(argv))
  except UserError as e:
    print(f"Error: {e}", file=sys.stderr, flush=True)
    return 2
  except Stopped as e:
    print(f"Stopped by {e}: the running variant's process was ended", file=sys.stderr, flush=True)
    return 128 + e.signum
  finally:
    for s, handler in handlers.items():
      signal.signal(s, handler)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
