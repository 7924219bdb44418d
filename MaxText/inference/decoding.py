"""Decoding with the training model: load its params, prefill a prompt into the KV cache, generate token by token.

The model is train.py's (training_setup.build), applied with the `cache` collection mutable: each attention layer
then keeps its keys and values in `cache/cached_key|cached_value` (layers.attentions.Attention), sharded by the
logical axes cache_batch / cache_sequence / cache_heads / cache_kv of logical_axis_rules.
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
from MaxText.configuration import pipeline_schedule
from MaxText.errors import UserError
from MaxText.features import lora, selection
from MaxText.inference import sampling
from MaxText.layers import context_parallel
from MaxText.runtime import sharding
from MaxText.training import starting_state, training_setup

# Tokens that end a completion besides the tokenizer's EOS (Llama 3: end of turn, end of text).
END_TOKENS = ("<|eot_id|>", "<|end_of_text|>")


def end_token_ids(tokenizer) -> tuple[int, ...]:
  """The ids at which a row stops: the tokenizer's EOS and those of END_TOKENS it has."""
  ids = {tokenizer.eos_id} | {tokenizer.token_id(t) for t in END_TOKENS}
  return tuple(sorted(i for i in ids if i is not None and i >= 0))


def build(config, mesh):
  """The model and its abstract, sharded params (whose memory is checked against a device's)."""
  if context_parallel.mesh_size(config, context_parallel.AXIS) > 1:
    raise UserError(
      "decoding does not run with context parallelism (it trains long sequences): set ici_context_parallelism=1 and "
      "dcn_context_parallelism=1 for decode.py; the checkpoint loads on any mesh"
    )
  if pipeline_schedule.stages(config.get_keys()) > 1:
    raise UserError(
      "decoding does not run with pipeline parallelism (it trains): set ici_pipeline_parallelism=1 and "
      "dcn_pipeline_parallelism=1 for decode.py; a pipelined run's checkpoint loads on any mesh"
    )
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


def sampler(config, valid_vocab: int):
  """pick(logits (B, V), rng) -> (B,) tokens: the config's sampling, over the ids below valid_vocab."""

  def pick(logits, rng):
    if valid_vocab < logits.shape[-1]:  # never sample ids the tokenizer cannot decode
      logits = jnp.where(jnp.arange(logits.shape[-1]) < valid_vocab, logits, -jnp.inf)
    return sampling.sample(
      logits,
      rng,
      config.decode_sampling_strategy,
      temperature=config.decode_sampling_temperature,
      top_k=config.decode_sampling_top_k,
      nucleus_p=config.decode_sampling_nucleus_p,
    )

  return pick


def on_every_process(x):
  """x replicated over the mesh: the rows of a batch may sit on other processes' devices, and every process reads
  the sampled tokens (to stop at end tokens, and to print)."""
  return jax.lax.with_sharding_constraint(x, PartitionSpec())


def _to_host(x) -> np.ndarray:
  """The whole array on this host, also when it spans other processes' devices."""
  if x.is_fully_addressable:
    return np.asarray(x)
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def prefill(model, pick, params, tokens, true_length, rng):
  """Runs the padded prompts (B, P) through the model from an empty cache; returns (cache, last logits, first token).

  Sampling draws from fold_in(rng, 0) here and fold_in(rng, i) at step i (all on the device, no eager ops).
  """
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  segment_ids = (positions < true_length[:, None]).astype(jnp.int32)  # 0: padding
  logits, variables = model.apply({"params": params}, tokens, positions, segment_ids, mutable=["cache"])
  last = jnp.take_along_axis(logits, (true_length - 1)[:, None, None], axis=1)[:, 0]  # (B, V)
  return nn.unbox(variables["cache"]), last, on_every_process(pick(last, jax.random.fold_in(rng, 0)))


def decode_step(model, pick, params, cache, tokens, positions, step, rng):
  """Feeds one token per row (B,) at `positions` (B,); returns (cache, logits, next token, positions + 1, step + 1)."""
  logits, variables = model.apply({"params": params, "cache": cache}, tokens[:, None], positions[:, None], mutable=["cache"])
  token = on_every_process(pick(logits[:, 0], jax.random.fold_in(rng, step)))
  return variables["cache"], logits[:, 0], token, positions + 1, step + 1


def generate(
  config, model, params, mesh, prompt_ids, end_ids=(), valid_vocab: int | None = None, keep_logits: bool = False
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
  """
  rows, padded = config.micro_batch_size_to_load, config.max_prefill_predict_length
  num_tokens = config.max_target_length - padded
  pick = sampler(config, valid_vocab or config.vocab_size)
  rows_sharding = NamedSharding(mesh, PartitionSpec(*config.data_sharding))
  tokens = np.zeros((rows, padded), np.int32)
  tokens[:, : len(prompt_ids)] = prompt_ids
  tokens = jax.device_put(tokens, rows_sharding)
  true_length = jax.device_put(np.full((rows,), len(prompt_ids), np.int32), rows_sharding)
  rng = jax.random.PRNGKey(config.decode_sampling_seed)
  end_ids = np.asarray(end_ids, np.int32)

  jax.block_until_ready((params, tokens, true_length))  # the prefill time excludes loading the params
  with sharding.logical_context(mesh, config):
    compiled = jax.jit(functools.partial(prefill, model, pick)).lower(params, tokens, true_length, rng).compile()
    start = time.perf_counter()
    cache, logits, token = jax.block_until_ready(compiled(params, tokens, true_length, rng))
    prefill_s = time.perf_counter() - start

    step = jax.jit(functools.partial(decode_step, model, pick), donate_argnums=(1,))
    positions, index = true_length, jnp.ones((), jnp.int32)
    step = step.lower(params, cache, token, positions, index, rng).compile()
    sampled, all_logits = [np.asarray(token)], [_to_host(logits)] if keep_logits else None
    done = np.isin(sampled[0], end_ids)
    start = time.perf_counter()
    for _ in range(1, num_tokens):
      if done.all():
        break
      cache, logits, token, positions, index = step(params, cache, token, positions, index, rng)
      sampled.append(np.asarray(token))  # waits for the step: the loop stops as soon as every row has ended
      done |= np.isin(sampled[-1], end_ids)
      if keep_logits:
        all_logits.append(_to_host(logits))
    steps_s = time.perf_counter() - start
  steps = len(sampled) - 1
  return Generation(
    tokens=np.stack(sampled, axis=1),
    logits=np.stack(all_logits, axis=1) if keep_logits else None,
    prefill_s=prefill_s,
    step_s=steps_s / steps if steps else 0.0,
    generated_per_s=rows * steps / steps_s if steps else 0.0,
  )


def completion(tokens, end_ids) -> list[int]:
  """A row's tokens up to (not including) its first end token."""
  tokens = [int(t) for t in tokens]
  ends = [i for i, t in enumerate(tokens) if t in set(end_ids)]
  return tokens[: ends[0]] if ends else tokens


def check_prompt(config, prompt_ids) -> None:
  """A UserError for a prompt that the cache cannot take."""
  if len(prompt_ids) > config.max_prefill_predict_length:
    raise UserError(
      f"the prompt is {len(prompt_ids)} tokens long but max_prefill_predict_length={config.max_prefill_predict_length}; "
      "shorten the prompt or raise max_prefill_predict_length"
    )
