"""LoRA and QLoRA (enable_lora) as a feature: the adapters on the dense layers (layers/lora.py; QLoRA's quantized base:
layers/qlora.py), the base params kept out of the optimizer (and QLoRA's codes out of differentiation), checkpoints of
the adapters only (the frozen base comes from load_parameters_path again), and the split of the params into the
frozen base and the adapters.
"""

import dataclasses

import jax
import jax.numpy as jnp
import optax

from MaxText import feature_protocol
from MaxText.errors import ConfigError, UserError
from MaxText.features import qlora_loading
from MaxText.layers import layer_names, qlora
from MaxText.layers import lora as adapters_layer
from MaxText.layers.lora import is_adapter, split


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
  names = sorted({adapters_layer.module_name(keys[:-1]) for keys, _ in layer_names.flatten(params) if keys[-1] == "kernel"})
  raise ConfigError(
    f"lora_module_path={config.lora_module_path!r} selects no dense layer; this model's are e.g. {', '.join(names[:6])}"
  )


def join(base: dict, adapters: dict) -> dict:
  """The params of a LoRA model from split()'s two parts."""
  return layer_names.merge(base, adapters)


def adapters_only(state):
  """The part of a train state (or of its abstract shape) that a LoRA checkpoint holds: the step, the optimizer
  state and the adapters; the frozen base comes from load_parameters_path again. A state without adapters as is."""
  adapters = split(state.params)[1]
  return state.replace(params=adapters) if adapters else state


class Lora(feature_protocol.Feature):
  name = "lora"

  def __init__(self, config):
    self.config = config
    self.spec = adapters_layer.from_config(config)

  def gemm(self, gemm):
    return dataclasses.replace(gemm, lora=self.spec)

  def optimizer(self, tx):
    return train_adapters_only(tx)

  def frozen(self, leaf) -> bool:
    return bool(self.spec.weight_qtype) and qlora.is_code(leaf)

  def bind_params(self, abstract_params) -> None:
    check_selects_layers(self.config, abstract_params)

  def counted_params(self, params):
    return qlora.float_layout(params, jnp.float32)  # QLoRA's codes as the weights they hold, their scales not at all

  def size_note(self, params, total: int) -> str:
    adapters = sum(x.size for x in jax.tree.leaves(split(params)[1]))  # PEFT's "trainable params"
    return f", of which {adapters:,} trainable LoRA adapters ({100 * adapters / total:.3f}%)" if adapters else ""

  def base_params(self, params):
    def base(path, x):
      return jnp.zeros_like(x) if getattr(path[-1], "key", None) == "lora_b" else x

    return jax.tree_util.tree_map_with_path(base, params)

  def saved(self, state):
    return adapters_only(state)

  def check_restore(self, tree: dict, abstract_state, where: str) -> None:
    lora_state = bool(split(tree["params"])[1])
    if not lora_state:
      raise UserError(
        f"{where} is the train state of a run without LoRA; with enable_lora=true give a LoRA run's checkpoint, "
        "or that model's params as load_parameters_path"
      )

  def load_params(self, load, tree: dict, abstract_params):
    """The base (and the adapters, when the checkpoint holds some: a PEFT adapter read in by convert_checkpoint.py);
    QLoRA reads the checkpoint's float kernels one at a time and quantizes them."""
    wanted = qlora.float_layout(abstract_params, self.config.weight_dtype) if self.spec.weight_qtype else abstract_params
    if not split(tree["params"])[1]:
      wanted = split(wanted)[0]  # the adapters start afresh
    if self.spec.weight_qtype:
      path, axis = self.config.load_parameters_path, self.config.param_scan_axis
      return qlora_loading.load(path, tree, wanted, abstract_params, axis)
    return load(wanted)


def _lora_state_without_lora(tree: dict, abstract_state, where: str) -> None:
  if split(tree["params"])[1] and not split(abstract_state.params)[1]:
    raise UserError(
      f"{where} holds a LoRA run's adapters and their optimizer state: set enable_lora=true (and its lora_* keys), "
      "with the base model as load_parameters_path"
    )


feature_protocol.register_restore_check(_lora_state_without_lora)
