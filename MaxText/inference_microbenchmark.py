"""Times decode.py's prefill at each prompt length and its autoregressive step, as upstream MaxText's microbenchmark:

    python3 MaxText/inference_microbenchmark.py MaxText/configs/base.yml run_name=x [model keys ...] \\
      inference_microbenchmark_prefill_lengths=64,128 inference_microbenchmark_stages=prefill,generate \\
      inference_microbenchmark_loop_iters=10 inference_microbenchmark_log_file_path=results.json

The params are those decode.py reads (load_parameters_path, ..., else random: the timing does not depend on them);
the batch is per_device_batch_size x devices rows. `prefill` runs generation/prefill_decode.py's prefill on prompts of
each length (all rows); `generate` runs its decode_step with a KV cache of max_target_length slots. Each is compiled
first, then timed over loop_iters runs. The JSON holds upstream's result names: Prefill/<length>/prefill_time_in_ms,
prefill_total_tflops, prefill_tflops_per_sec_per_device; AutoRegressive/step_in_ms, step_in_ms_per_seq,
global_batch_size, total_throughput_tokens_per_second, device_bandwidth_utilization (of the memory roofline:
decode_roofline; null where the device's bandwidth is unknown).
"""

import functools
import json
import os
import sys
import time

if __package__ in (None, ""):  # Run as `python3 MaxText/inference_microbenchmark.py`: import this checkout's MaxText.
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from MaxText import pyconfig  # pylint: disable=wrong-import-position
from MaxText.errors import UserError  # pylint: disable=wrong-import-position
from MaxText.runtime.entry_point import run_and_exit_on_user_error  # pylint: disable=wrong-import-position

# upstream's `insert` copies a prefill's cache into a slot of JetStream's decode state; here the prefill writes the
# decode cache itself, so there is nothing to time: the stage is accepted (upstream's scripts name it) and noted.
STAGES = ("prefill", "insert", "generate")


def parse_keys(config) -> tuple[list[int], list[str]]:
  """(prefill lengths, stages) of the inference_microbenchmark_* keys; a UserError names a wrong one."""
  try:
    lengths = [int(x) for x in str(config.inference_microbenchmark_prefill_lengths).split(",")]
  except ValueError:
    lengths = []
  if not lengths or any(not 1 <= n <= config.max_target_length for n in lengths):
    raise UserError(
      f"inference_microbenchmark_prefill_lengths={config.inference_microbenchmark_prefill_lengths} must be "
      f"comma-separated lengths in [1, max_target_length={config.max_target_length}]"
    )
  stages = [s.strip() for s in config.inference_microbenchmark_stages.split(",")]
  if not stages or any(s not in STAGES for s in stages):
    raise UserError(
      f"inference_microbenchmark_stages={config.inference_microbenchmark_stages} must be stages among "
      f"{', '.join(STAGES)} (comma-separated)"
    )
  iterations, needed = (
    config.inference_microbenchmark_loop_iters,
    min(lengths) + 1 + config.inference_microbenchmark_loop_iters,
  )
  if "generate" in stages and needed > config.max_target_length:
    raise UserError(
      f"inference_microbenchmark_loop_iters={iterations} generate steps after a {min(lengths)}-token prompt need "
      f"max_target_length >= {needed} (now {config.max_target_length})"
    )
  return lengths, stages


def _timed(fn, iterations: int, *args):
  """(mean seconds per call, the last result) over `iterations` calls, after one untimed call."""
  import jax  # pylint: disable=import-outside-toplevel

  result = jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  for _ in range(iterations):
    result = jax.block_until_ready(fn(*args))
  return (time.perf_counter() - start) / iterations, result


def prefill_results(config, model, params, pick, rows: int, length: int) -> tuple[dict, tuple]:
  """Upstream's Prefill/<length> results, and the last prefill's (cache, logits, token)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from MaxText.generation import prefill_decode  # pylint: disable=import-outside-toplevel
  from MaxText.training import flops  # pylint: disable=import-outside-toplevel

  tokens = jax.random.randint(jax.random.PRNGKey(0), (rows, length), 0, config.vocab_size, jnp.int32)
  true_length = jnp.full((rows,), length, jnp.int32)
  step = jax.jit(functools.partial(prefill_decode.prefill, model, pick))
  seconds, out = _timed(step, config.inference_microbenchmark_loop_iters, params, tokens, true_length, jax.random.PRNGKey(0))
  forward = config.replace(max_target_length=length, gradient_accumulation_steps=1)
  tflops = flops.training_tflops_per_device(forward).total_tflops / 3  # the forward pass: a third of training's
  results = {
    "prefill_time_in_ms": seconds * 1e3,
    "prefill_total_tflops": tflops * jax.device_count(),
    "prefill_tflops_per_sec_per_device": tflops / seconds,
  }
  return results, out


def generate_results(config, model, params, pick, rows: int, length: int, prefilled: tuple) -> dict:
  """Upstream's AutoRegressive results: loop_iters decode steps after a prefill of `length` tokens, each reading the
  whole KV cache (donated and updated, as decode.py's)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from MaxText.generation import prefill_decode  # pylint: disable=import-outside-toplevel
  from MaxText.inference import decode_roofline  # pylint: disable=import-outside-toplevel

  cache, _, token = prefilled
  positions, index, rng = jnp.full((rows,), length, jnp.int32), jnp.ones((), jnp.int32), jax.random.PRNGKey(0)
  step = jax.jit(functools.partial(prefill_decode.decode_step, model, pick), donate_argnums=(1,))
  cache, _, token, positions, index = jax.block_until_ready(step(params, cache, token, positions, index, rng))
  iterations = config.inference_microbenchmark_loop_iters
  start = time.perf_counter()
  for _ in range(iterations):
    cache, _, token, positions, index = step(params, cache, token, positions, index, rng)
  jax.block_until_ready(token)
  seconds = (time.perf_counter() - start) / iterations
  bandwidth = decode_roofline.bandwidth_gbps()
  step_bytes = decode_roofline.device_bytes(params) + decode_roofline.kv_cache_bytes(config, rows)
  return {
    "step_in_ms": seconds * 1e3,
    "step_in_ms_per_seq": seconds * 1e3 / rows,
    "global_batch_size": rows,
    "total_throughput_tokens_per_second": rows / seconds,
    "device_bandwidth_utilization": step_bytes / seconds / (bandwidth * 1e9) if bandwidth else None,
  }


def run(config) -> dict:
  """The results of the configured stages (see the module doc)."""
  from MaxText.generation import prefill_decode  # pylint: disable=import-outside-toplevel
  from MaxText.inference import decoding  # pylint: disable=import-outside-toplevel
  from MaxText.runtime import mesh, sharding  # pylint: disable=import-outside-toplevel

  lengths, stages = parse_keys(config)
  device_mesh = mesh.create_device_mesh(config)
  model, abstract = decoding.build(config, device_mesh)
  params = decoding.load_params(config, model, abstract, device_mesh)
  rows, pick = config.micro_batch_size_to_load, prefill_decode.sampler(config, config.vocab_size)
  results = {}
  with sharding.logical_context(device_mesh, config):
    for length in lengths if "prefill" in stages else []:
      results.setdefault("Prefill", {})[str(length)] = prefill_results(config, model, params, pick, rows, length)[0]
    if "generate" in stages:  # after the shortest prompt, so that the steps stay inside the cache
      prefilled = prefill_results(config, model, params, pick, rows, min(lengths))[1]
      results["AutoRegressive"] = generate_results(config, model, params, pick, rows, min(lengths), prefilled)
  return results


def main(argv: list[str]) -> None:
  config = pyconfig.initialize(argv, reads_data=False)
  from MaxText import max_logging  # pylint: disable=import-outside-toplevel

  if "insert" in parse_keys(config)[1]:
    max_logging.log("Stage insert: prefill writes the decode cache itself here, so there is no insert to time")
  results = run(config)
  for length, prefill in results.get("Prefill", {}).items():
    max_logging.log(
      f"Prefill length {length}: {prefill['prefill_time_in_ms']:.3f} ms, "
      f"{prefill['prefill_tflops_per_sec_per_device']:.3f} TFLOP/s/device"
    )
  if "AutoRegressive" in results:
    ar = results["AutoRegressive"]
    utilization = ar["device_bandwidth_utilization"]
    max_logging.log(
      f"AutoRegressive: {ar['step_in_ms']:.3f} ms a step of {ar['global_batch_size']} rows, "
      f"{ar['total_throughput_tokens_per_second']:.1f} tokens/s, "
      + (f"{100 * utilization:.1f}% of the memory roofline" if utilization else "memory bandwidth unknown")
    )
  path = config.inference_microbenchmark_log_file_path
  if path:
    try:
      with open(path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    except OSError as e:
      raise UserError(f"inference_microbenchmark_log_file_path={path} cannot be written: {e.strerror or e}") from None
    max_logging.log(f"Wrote {path}")


if __name__ == "__main__":
  run_and_exit_on_user_error(main, sys.argv)
