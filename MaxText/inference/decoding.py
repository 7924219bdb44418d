"""decode.py's driver: build the training model, load its params (a checkpoint, LoRA's base and adapters, a serving
checkpoint), and generate from one prompt in every row with generation/'s prefill and decode step, timed.
"""

import dataclasses
import functools
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec

from MaxText import max_logging
from MaxText.checkpoints import checkpointing, serving_checkpoint
from MaxText.errors import UserError
from MaxText.features import lora, selection
from MaxText.generation import prefill_decode
from MaxText.runtime import sharding
from MaxText.training import starting_state, training_setup


def build(config, mesh):
  """The model and its abstract, sharded params (whose memory is checked against a device's)."""
  prefill_decode.check_mesh(config, "decode.py")
  setup = training_setup.build(config, mesh, params_only=True)
  return setup.model, setup.abstract_state.params


def latest_run_checkpoint(config) -> str | None:
  """<checkpoint_dir>/<N>/items of the newest step N of this run (run_name under base_output_directory), or None."""
  if not config.run_name:
    return None
  directory = epath.Path(config.checkpoint_dir)
  if not directory.is_dir():
    return None
  steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit() and (p / checkpointing.STATE_ITEM).is_dir()]
  return str(directory / str(max(steps)) / checkpointing.STATE_ITEM) if steps else None


def load_params(config, model, abstract_params, mesh):
  """The params to decode with, from (in order) load_parameters_path, load_full_state_path (its params only),
  this run's latest checkpoint, or a random init (with a warning that the output is random)."""
  if config.checkpoint_is_quantized:  # a serving checkpoint of int8 kernels and their scales
    return serving_checkpoint.load(config, abstract_params)
  if lora.split(abstract_params)[1]:
    return _lora_params(config, model, abstract_params, mesh)
  _warn_if_the_run_has_adapters(config)
  for key in ("load_parameters_path", "load_full_state_path"):
    path = getattr(config, key)
    if path:
      return checkpointing.load_params(path, abstract_params, config.param_scan_axis, key=key)
  path = latest_run_checkpoint(config)
  if path is not None:
    max_logging.log(f"Decoding the latest checkpoint of run {config.run_name}: {path}")
    return checkpointing.load_params(path, abstract_params, config.param_scan_axis, key="the run's latest checkpoint")
  max_logging.warn(
    "no checkpoint (load_parameters_path, load_full_state_path, or a run of this run_name): the params are random, "
    "so the output is random"
  )
  return random_params(config, model, abstract_params, mesh)


def _warn_if_the_run_has_adapters(config) -> None:
  """A LoRA run's checkpoint named by run_name, decoded without enable_lora, would be its base alone (or not fit)."""
  path = latest_run_checkpoint(config)
  if path is None or not (config.load_parameters_path or config.load_full_state_path):
    return
  if lora.split(checkpointing.tree_metadata(path, "the run's latest checkpoint")["params"])[1]:
    max_logging.warn(
      f"run {config.run_name}'s latest checkpoint holds LoRA adapters, which this decode leaves out (the base alone): "
      "set enable_lora=true with the run's lora_* keys (its config.yml) to decode with them"
    )


def _lora_params(config, model, abstract_params, mesh):
  """A LoRA model's params: the base from load_parameters_path (as training holds it: QLoRA's quantized), the
  adapters from this run's latest checkpoint (which holds them only), else from load_parameters_path when it holds
  some (convert_checkpoint.py to_maxtext --peft_adapter)."""
  if not config.load_parameters_path:
    raise UserError(
      "decoding with enable_lora=true needs load_parameters_path: the base model that the adapters were trained on"
    )
  base, adapters = lora.split(starting_state.load_parameters(config, selection.for_config(config), abstract_params))
  path = latest_run_checkpoint(config)
  if path is not None:
    max_logging.log(f"Decoding with the adapters of run {config.run_name}'s latest checkpoint: {path}")
    wanted = lora.split(abstract_params)[1]
    adapters = checkpointing.load_params(path, wanted, config.param_scan_axis, key="the run's latest checkpoint")
  elif not adapters:
    max_logging.warn(f"no adapters (no checkpoint of run {config.run_name}): decoding the base model alone")
    adapters = lora.split(random_params(config, model, abstract_params, mesh))[1]  # B = 0: the base's output
  return lora.join(base, adapters)


def random_params(config, model, abstract_params, mesh):
  """The params of a fresh init (init_weights_seed), laid out as abstract_params."""
  shardings = jax.tree.map(lambda a: a.sharding, abstract_params)

  def init(rng):
    tokens = jnp.ones((1, 1), jnp.int32)
    return nn.unbox(model.init({"params": rng, "dropout": rng}, tokens, jnp.zeros_like(tokens)))["params"]

  with sharding.logical_context(mesh, config):
    return jax.jit(init, out_shardings=shardings)(jax.random.PRNGKey(config.init_weights_seed))


@dataclasses.dataclass
class Generation:
  """What generate returns.

  Attributes:
    tokens: (B, N) the sampled tokens of each row, the first from the prefill; a row's tokens after its first
      end token are not meaningful.
    logits: (B, N, V) float32 logits that each token was sampled from (with keep_logits), else None.
    prefill_s: seconds of the prefill (compiled beforehand).
    step_s: seconds per generated token after the first (the mean over the generation steps; 0 without steps).
    generated_per_s: tokens generated per second over all rows (the steps after the prefill).
  """

  tokens: np.ndarray
  logits: np.ndarray | None
  prefill_s: float
  step_s: float
  generated_per_s: float


def generate(
  config,
  model,
  params,
  mesh,
  prompt_ids,
  end_ids=(),
  valid_vocab: int | None = None,
  keep_logits: bool = False,
  images=None,
) -> Generation:
  """Samples max_target_length - max_prefill_predict_length tokens after the prompt in each of the batch rows,
  stopping early once every row has produced an end token.

  Args:
    config: the Config (sampling keys, lengths, decode_sampling_seed).
    model, params: the Transformer and its (sharded) params.
    mesh: the device mesh.
    prompt_ids: the prompt's token ids (1 <= len <= max_prefill_predict_length), the same for every row.
    end_ids: token ids that end a row.
    valid_vocab: sample only ids below it (the tokenizer's vocabulary); default: all of vocab_size.
    keep_logits: also return the logits of every sampled token (for tests).
    images: None, or the prompt's images (N, C, H, W) (use_multimodal: its soft tokens are in prompt_ids), the same
      for every row.
  """
  rows, padded = config.micro_batch_size_to_load, config.max_prefill_predict_length
  num_tokens = config.max_target_length - padded
  pick = prefill_decode.sampler(config, valid_vocab or config.vocab_size)
  rows_sharding = NamedSharding(mesh, PartitionSpec(*config.data_sharding))
  tokens = np.zeros((rows, padded), np.int32)
  tokens[:, : len(prompt_ids)] = prompt_ids
  tokens = jax.device_put(tokens, rows_sharding)
  true_length = jax.device_put(np.full((rows,), len(prompt_ids), np.int32), rows_sharding)
  rng = jax.random.PRNGKey(config.decode_sampling_seed)
  end_ids = np.asarray(end_ids, np.int32)
  if images is not None:
    images = jax.device_put(np.broadcast_to(images, (rows, *np.shape(images))), rows_sharding)

  jax.block_until_ready((params, tokens, true_length))  # the prefill time excludes loading the params
  with sharding.logical_context(mesh, config):
    prefill = jax.jit(functools.partial(prefill_decode.prefill, model, pick))
    compiled = prefill.lower(params, tokens, true_length, rng, images).compile()
    start = time.perf_counter()
    cache, logits, token = jax.block_until_ready(compiled(params, tokens, true_length, rng, images))
    prefill_s = time.perf_counter() - start

    step = jax.jit(functools.partial(prefill_decode.decode_step, model, pick), donate_argnums=(1,))
    positions, index = true_length, jnp.ones((), jnp.int32)
    step = step.lower(params, cache, token, positions, index, rng).compile()
    sampled, all_logits = [np.asarray(token)], [prefill_decode.to_host(logits)] if keep_logits else None
    done = np.isin(sampled[0], end_ids)
    start = time.perf_counter()
    for _ in range(1, num_tokens):
      if done.all():
        break
      cache, logits, token, positions, index = step(params, cache, token, positions, index, rng)
      sampled.append(np.asarray(token))  # waits for the step: the loop stops as soon as every row has ended
      done |= np.isin(sampled[-1], end_ids)
      if keep_logits:
        all_logits.append(prefill_decode.to_host(logits))
    steps_s = time.perf_counter() - start
  steps = len(sampled) - 1
  return Generation(
    tokens=np.stack(sampled, axis=1),
    logits=np.stack(all_logits, axis=1) if keep_logits else None,
    prefill_s=prefill_s,
    step_s=steps_s / steps if steps else 0.0,
    generated_per_s=rows * steps / steps_s if steps else 0.0,
  )
