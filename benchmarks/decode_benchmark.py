"""Generated tokens/s of decode.py's KV cache, against the memory roofline and against recomputing the whole
sequence for every token.

    python3 benchmarks/decode_benchmark.py MaxText/configs/base.yml [model keys ...] [--tokens 256] [--batches 1,64]

For each batch size: the cached generation of decoding.generate (prefill, then one token per step), and a
baseline that runs the model over the whole (padded) sequence for every new token (--skip_recompute leaves it
out), both greedy and compiled before they are timed, with the same params (random: the speed does not depend
on the weights). Prints the time per generated token and the tokens/s of both, and their ratio.

The benchmark sets each run's per_device_batch_size (from --batches), max_target_length and
max_prefill_predict_length (from --prompt_length and --tokens), decode_sampling_strategy (greedy) and the params
(random, so load_parameters_path and load_full_state_path are not read): given on the command line or as M_<KEY>,
these keys are refused with one line.

The roofline: a generation step reads at least every parameter and the whole KV cache (max_target_length
slots, which the cache attention reads whatever the position) once, so it takes at least those bytes over the
device's memory bandwidth (aot_targets.CHIPS by device kind, or --hbm_gbps); "% roofline" is the cached
tokens/s over the roofline's. On one device; with several, the bytes are those of the first device's shards.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from MaxText import pyconfig  # noqa: E402
from MaxText.configuration import config_loader
from MaxText.errors import UserError  # noqa: E402
from MaxText.inference import decode_roofline, decoding
from MaxText.runtime import cli_args, mesh, sharding
from MaxText.runtime.entry_point import run_and_exit_on_user_error  # noqa: E402


def _recompute_per_token_s(config, model, params, device_mesh, rows: int, prompt_length: int, tokens: int) -> float:
  """Seconds per generated token when every token reruns the model over the whole padded sequence."""
  length = config.max_target_length

  def next_token(params, sequence, t):
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), sequence.shape)
    logits = model.apply({"params": params}, sequence, positions)
    token = jnp.argmax(logits[:, t - 1], axis=-1).astype(jnp.int32)
    return sequence.at[:, t].set(token)

  sequence = jnp.ones((rows, length), jnp.int32)
  with sharding.logical_context(device_mesh, config):
    step = jax.jit(next_token, donate_argnums=(1,)).lower(params, sequence, prompt_length).compile()
    start = time.perf_counter()
    for t in range(prompt_length, prompt_length + tokens):
      sequence = step(params, sequence, t)
    jax.block_until_ready(sequence)
  return (time.perf_counter() - start) / tokens


def _batch_sizes(text: str) -> list[int]:
  try:
    return [cli_args.int_at_least(1)(b) for b in text.split(",")]
  except argparse.ArgumentTypeError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive integers, e.g. 1,64") from None


# Keys that the benchmark sets itself (each row's batch and lengths, greedy decoding, random params): given on the
# command line or as M_<KEY>, they are refused instead of overridden.
SET_BY_THE_BENCHMARK = {
  "per_device_batch_size": "--batches gives each run's rows, over all devices",
  "max_target_length": "it is max(--prompt_length, 8) + --tokens + 1",
  "max_prefill_predict_length": "it is max(--prompt_length, 8)",
  "decode_sampling_strategy": "the benchmark decodes greedily",
  "load_parameters_path": "the params are random (the speed does not depend on them)",
  "load_full_state_path": "the params are random (the speed does not depend on them)",
}


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
  """The flags, checked, and the config arguments ([config.yml, key=value, ...]); a mistake is a UserError."""
  parser = cli_args.OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--tokens", type=cli_args.int_at_least(1), default=256, help="tokens to generate")
  parser.add_argument("--batches", type=_batch_sizes, default=[1, 64], help="comma-separated batch sizes (rows)")
  parser.add_argument("--prompt_length", type=cli_args.int_at_least(1), default=8, help="prompt tokens (BOS and 1s)")
  parser.add_argument(
    "--hbm_gbps",
    type=cli_args.positive_number(),
    default=None,
    help="memory bandwidth in GB/s (default: the device's, if known)",
  )
  parser.add_argument("--skip_recompute", action="store_true", help="leave out the recompute baseline")
  args, config_args = parser.parse_known_args(argv[1:])
  _, sources = config_loader.load_raw_config([argv[0], *config_args], os.environ)
  for key, why in SET_BY_THE_BENCHMARK.items():
    if sources[key] in (config_loader.SOURCE_CLI, config_loader.SOURCE_ENV):
      raise UserError(f"{key} is set by the benchmark ({why}); leave it out")
  return args, config_args


def row_configs(argv0: str, config_args: list[str], args) -> dict:
  """rows -> the config of that batch. The config is read before JAX's backend starts, as train.py does: it keeps
  libtpu off a host without TPUs and applies xla_flags_preset; its mistakes are one line before the table."""
  prefill = max(args.prompt_length, 8)
  fixed = {
    "run_name": "",
    "load_parameters_path": "",
    "load_full_state_path": "",
    "dataset_type": "synthetic",
    "max_prefill_predict_length": prefill,
    "max_target_length": prefill + args.tokens + 1,  # the prefill samples 1 token, then `tokens` steps
    "decode_sampling_strategy": "greedy",
  }
  pyconfig.initialize([argv0, *config_args], per_device_batch_size=1, **fixed)  # then the devices are known
  devices = jax.devices()
  return {
    rows: pyconfig.initialize([argv0, *config_args], devices=devices, per_device_batch_size=rows / len(devices), **fixed)
    for rows in args.batches
  }


def main(argv) -> None:
  args, config_args = parse_args(argv)
  configs = row_configs(argv[0], config_args, args)
  bandwidth = decode_roofline.bandwidth_gbps(args.hbm_gbps)
  print(f"{jax.devices()[0].device_kind}: memory bandwidth {f'{bandwidth:g} GB/s' if bandwidth else 'unknown (--hbm_gbps)'}")
  print("Params: random (the timing does not depend on them)")
  print(
    f"{'rows':>4} {'cached ms/token':>16} {'cached tok/s':>13} {'roofline tok/s':>15} {'% roofline':>11} "
    f"{'recompute ms/token':>19} {'recompute tok/s':>16} {'ratio':>6}"
  )
  for rows, config in configs.items():
    device_mesh = mesh.create_device_mesh(config)
    model, abstract = decoding.build(config, device_mesh)
    params = decoding.random_params(config, model, abstract, device_mesh)
    prompt = [1] * args.prompt_length
    cached = decoding.generate(config, model, params, device_mesh, prompt)
    roofline = decode_roofline.roofline_tokens_per_s(
      rows, decode_roofline.device_bytes(params) + decode_roofline.kv_cache_bytes(config, rows), bandwidth
    )
    of_roofline = f"{100 * cached.generated_per_s / roofline:>10.1f}%" if roofline else f"{'n/a':>11}"
    roofline_text = f"{roofline:>15.1f}" if roofline else f"{'n/a':>15}"
    line = f"{rows:>4} {cached.step_s * 1e3:>16.2f} {cached.generated_per_s:>13.1f} {roofline_text} {of_roofline}"
    if not args.skip_recompute:
      recompute_s = _recompute_per_token_s(config, model, params, device_mesh, rows, args.prompt_length, args.tokens)
      line += f" {recompute_s * 1e3:>19.2f} {rows / recompute_s:>16.1f} {recompute_s / cached.step_s:>5.1f}x"
    print(line, flush=True)
    np.testing.assert_equal(cached.tokens.shape[1], args.tokens + 1)


if __name__ == "__main__":
  run_and_exit_on_user_error(main, sys.argv)
