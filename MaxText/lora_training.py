"""LoRA on the train step's side: the base params stay out of the optimizer, the run's checks, and the split of the
params into the frozen base and the adapters (the part a LoRA checkpoint holds).

The adapters themselves are in layers/lora.py.
"""

import jax
import jax.numpy as jnp
import optax

from MaxText.errors import ConfigError
from MaxText.layers import layer_names, lora, qlora


def is_adapter(keys: tuple) -> bool:
  return bool(keys) and keys[-1] in lora.ADAPTER_PARAMS


def _zero_like_sharded(g):
  """Zeros computed from the gradient g, which ties g to the params' sharding: with zeros that do not read it, the
  base's gradients (only reduced to norms then) were held whole on every device (llama2-7b on v5e-8: 25.5 GiB of
  temporaries, against 5.5 GiB). where(): a non-finite g still gives 0."""
  return jnp.where(jnp.isfinite(g), g * 0, 0).astype(g.dtype)


def train_adapters_only(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
  """`optimizer` on the adapters alone: its state holds adapter-shaped trees only, and the base gets zero updates.

  (optax.multi_transform would do the same but leaves MaskedNode placeholders in the state, which the sharded
  state's tree of shardings does not hold.)
  """

  def init(params):
    return optimizer.init(split(params)[1])

  def update(grads, state, params=None):
    base, adapter_grads = split(grads)
    adapter_params = None if params is None else split(params)[1]
    updates, state = optimizer.update(adapter_grads, state, adapter_params)
    return join(jax.tree.map(_zero_like_sharded, base), updates), state

  return optax.GradientTransformation(init, update)


def check_selects_layers(config, params) -> None:
  """A ConfigError naming lora_module_path and some real layer names when it selects no dense layer."""
  if any(is_adapter(keys) for keys, _ in layer_names.flatten(params)):
    return
  names = sorted({lora.module_name(keys[:-1]) for keys, _ in layer_names.flatten(params) if keys[-1] == "kernel"})
  raise ConfigError(
    f"lora_module_path={config.lora_module_path!r} selects no dense layer; this model's are e.g. {', '.join(names[:6])}"
  )


def split(params) -> tuple[dict, dict]:
  """(base, adapters): two trees of the params' nesting, each holding only its own leaves."""
  return layer_names.partition(params, lambda keys, _: is_adapter(keys))


def split_codes(params) -> tuple[dict, dict]:
  """(QLoRA's quantized kernels, the other params): the first are integer or fp8 codes, which are not differentiated."""
  other, codes = layer_names.partition(params, lambda _, leaf: qlora.is_code(leaf))
  return codes, other


def zero_codes(codes: dict) -> dict:
  """The codes' zero "gradients", in their dtype and computed from them (so sharded like them)."""
  return jax.tree.map(lambda c: c * jnp.zeros((), c.dtype), codes)


def join(base: dict, adapters: dict) -> dict:
  """The params of a LoRA model from split()'s two parts."""
  out = dict(base)
  for key, value in adapters.items():
    out[key] = join(out.get(key, {}), value) if isinstance(value, dict) else value
  return out


def model_size(params) -> tuple[int, int]:
  """(the model's parameters, its LoRA adapters'): QLoRA's codes count as the weights they hold (nf4 packs two per
  byte) and their scales not at all."""
  total = sum(x.size for x in jax.tree.leaves(qlora.float_layout(params, jnp.float32)))
  return total, sum(x.size for x in jax.tree.leaves(split(params)[1]))


def describe_size(params) -> str:
  """The run log's count; with LoRA also the adapters' share, the part that trains (PEFT's "trainable params")."""
  total, adapters = model_size(params)
  line = f"{total / 1e9:.6f} billion ({total:,})"
  return line + (f", of which {adapters:,} trainable LoRA adapters ({100 * adapters / total:.3f}%)" if adapters else "")


def adapters_only(state):
  """The part of a train state (or of its abstract shape) that a LoRA checkpoint holds: the step, the optimizer
  state and the adapters; the frozen base comes from load_parameters_path again. A state without adapters as is."""
  adapters = split(state.params)[1]
  return state.replace(params=adapters) if adapters else state
