"""Generated tokens/s of decode.py's KV cache against recomputing the whole sequence for every token.

    python3 benchmarks/decode_benchmark.py MaxText/configs/base.yml [model keys ...] [--tokens 256] [--batches 1,8]

For each batch size: the cached generation of decoding.generate (prefill, then one token per step), and a
baseline that runs the model over the whole (padded) sequence for every new token, both greedy and compiled
before they are timed, with the same params (random: the speed does not depend on the weights). Prints the
time per generated token and the tokens/s of both, and their ratio.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from MaxText import decoding, mesh, pyconfig, sharding  # noqa: E402
from MaxText.errors import run_and_exit_on_user_error  # noqa: E402


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


def main(argv) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--tokens", type=int, default=256, help="tokens to generate")
  parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes (rows)")
  parser.add_argument("--prompt_length", type=int, default=8, help="prompt tokens (BOS and 1s)")
  args, config_args = parser.parse_known_args(argv[1:])
  print(
    f"{'rows':>4} {'cached ms/token':>16} {'cached tok/s':>13} {'recompute ms/token':>19} {'recompute tok/s':>16} "
    f"{'ratio':>6}"
  )
  for rows in (int(b) for b in args.batches.split(",")):
    prefill = max(args.prompt_length, 8)
    config = pyconfig.initialize(
      [argv[0], *config_args],
      run_name="",
      load_parameters_path="",
      load_full_state_path="",
      dataset_type="synthetic",
      per_device_batch_size=rows / jax.device_count(),
      max_prefill_predict_length=prefill,
      max_target_length=prefill + args.tokens + 1,  # the prefill samples 1 token, then `tokens` steps
      decode_sampling_strategy="greedy",
    )
    device_mesh = mesh.create_device_mesh(config)
    model, abstract = decoding.build(config, device_mesh)
    params = decoding.load_params(config, model, abstract, device_mesh)
    prompt = [1] * args.prompt_length
    cached = decoding.generate(config, model, params, device_mesh, prompt)
    recompute_s = _recompute_per_token_s(config, model, params, device_mesh, rows, args.prompt_length, args.tokens)
    print(
      f"{rows:>4} {cached.step_s * 1e3:>16.2f} {cached.generated_per_s:>13.1f} {recompute_s * 1e3:>19.2f} "
      f"{rows / recompute_s:>16.1f} {recompute_s / cached.step_s:>5.1f}x",
      flush=True,
    )
    np.testing.assert_equal(cached.tokens.shape[1], args.tokens + 1)


if __name__ == "__main__":
  run_and_exit_on_user_error(main, sys.argv)
