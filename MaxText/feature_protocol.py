"""The protocol of an optional training feature, and the few helpers the core runs over a run's features.

A feature (DPO, LoRA, fp8, numerics statistics, the routing bias, ...) is one module with one `Feature` subclass. It
overrides only the hooks it needs; every default does nothing. The core (the train step, the train state, the
starting state, the step loop, evaluation, checkpointing) calls these hooks over the run's features, in the order
features/selection.py chooses them from the config, and names none of them. docs/code.md has a worked example.

This module sits at the bottom of the import graph: it imports no MaxText module.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class StepContext(NamedTuple):
  """What an objective, a loss term and a microbatch result see of one forward pass.

  Attributes:
    params: the params the loss is taken of.
    batch: the microbatch, in the layout the model sees (prepare_batch applied).
    logits: (B, T, V) float32 logits of the forward pass.
    sown: the `intermediates` collection the forward pass sowed.
    inputs: every feature's step input, by feature name (what step_input returned).
    forward: (params, collections, deterministic) -> (logits, sown): the model once more, e.g. on a frozen copy.
    train: whether this is a train step (False: eval).
    weights: the objective's weights (the loss's denominator); 0 until the objective has run.
  """

  params: Any
  batch: dict
  logits: jax.Array
  sown: dict
  inputs: dict
  forward: Callable
  train: bool
  weights: jax.Array | float = 0.0


class Objective(NamedTuple):
  """What an objective gives for a microbatch: the summed loss, its weights (the denominator of the mean), and metrics
  summed as the loss is (each logged as its mean: value / weights). A metric whose mean has another denominator (a KL
  per token where the loss is per sequence) is a pair (sum, count): both are summed over microbatches, and it is
  logged as sum / count."""

  loss: jax.Array
  weights: jax.Array
  metrics: dict


class Feature:
  """An optional training feature. Subclass it, set `name`, and override the hooks the feature needs."""

  name: str = ""  # unique: it keys the feature's step input and its microbatch result
  model_state: tuple[str, ...] = ()  # slots that are model variable collections (a frozen model copy takes them too)
  # Slots that hold another model, of its own config (a distillation teacher): laid out as its config says, so the
  # features that lay out the run's model (the pipeline's layer order) leave them alone.
  own_layout: tuple[str, ...] = ()

  # -- The model, the optimizer, the train state --------------------------------------------------------------

  def gemm(self, gemm):
    """The dense layers' Gemm (layers/linears.py) with this feature's change: a quantizer, a tap, adapters."""
    return gemm

  def optimizer(self, tx):
    """The optax transformation with this feature's wrapper (train some params only, keep some out of it)."""
    return tx

  def slots(self, variables: dict) -> dict:
    """This feature's entries of TrainState.slots at init ({slot name: pytree}), from model.init's variables."""
    del variables
    return {}

  def frozen(self, leaf) -> bool:
    """Whether a param leaf is held constant and not differentiated by the step (e.g. integer codes)."""
    del leaf
    return False

  def bind_params(self, abstract_params) -> None:
    """Sees the model's params (shapes only) once they are known: raises a ConfigError when the feature cannot act on
    them, or plans over them."""
    del abstract_params

  def bind_state(self, abstract_state) -> None:
    """Sees the whole train state (shapes, dtypes and shardings, the slots too) once it is known: e.g. what a slot
    that on_start fills at every start holds, where a checkpoint does not hold it."""
    del abstract_state

  def base_params(self, params):
    """The params of the model the run started from, where this feature can tell them from the params (LoRA: the
    adapters' B zeroed); None: it cannot."""
    del params

  def counted_params(self, params):
    """The params as the run log and the AOT report count them (QLoRA: its codes as the weights they hold)."""
    return params

  def size_note(self, params, total: int) -> str:
    """A clause after the run log's parameter count `total` (LoRA: its adapters' trainable share); "" for none."""
    del params, total
    return ""

  # -- Each step ------------------------------------------------------------------------------------------------

  def prepare_batch(self, batch: dict) -> dict:
    """The batch in the layout the model expects."""
    return batch

  def step_input(self, state, batch: dict, train: bool):
    """This step's input, differentiated with the params (its gradient reaches `result`); None: no input."""
    del state, batch, train

  def step_constant(self, state, train: bool):
    """A step input held constant (not differentiated), e.g. a frozen reference model; None: none."""
    del state, train

  def collections(self, step_input) -> dict:
    """The model variable collections that this feature's step input feeds ({collection: pytree})."""
    del step_input
    return {}

  def objective(self, ctx: StepContext, constant) -> Objective | None:
    """The loss that replaces the cross-entropy (at most one feature of a run has one); None: cross-entropy."""
    del ctx, constant

  def loss_terms(self, ctx: StepContext) -> dict:
    """Terms added to the training loss ({name: value summed as the loss is}); each is logged as learning/<name>."""
    del ctx
    return {}

  def result(self, ctx: StepContext, input_gradient):
    """What a microbatch gives this feature (from the forward pass and its input's gradient); None: nothing."""
    del ctx, input_gradient

  def start(self, result_shape, step_input):
    """The value gradient accumulation combines the microbatches' results into (the identity of `combine`)."""
    del step_input
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), result_shape)

  def combine(self, a, b):
    """Two microbatches' results as one."""
    return jax.tree.map(jnp.add, a, b)

  def after_update(self, state, result):
    """The state after the optimizer's update, with this feature's own update applied (from the summed result)."""
    del result
    return state

  def metrics(self, result) -> dict:
    """Metrics of the step from the summed result, beside the core's."""
    del result
    return {}

  # -- Starting, saving and restoring -----------------------------------------------------------------------------

  def on_start(self, state):
    """The state a run starts its loop from, after its init or restore (e.g. a frozen copy taken at step 0)."""
    return state

  def logical(self, state):
    """The state as the model and checkpoints order it, from the order the run holds it in (the inverse of the part
    of on_start that reorders)."""
    return state

  def saved(self, state):
    """The part of a state (or of its abstract shape) that a checkpoint holds."""
    return state

  def check_restore(self, tree: dict, abstract_state, where: str) -> None:
    """Raises a UserError when a checkpoint's tree of metadata cannot restore into this run's state."""
    del tree, abstract_state, where

  def load_params(self, load: Callable, tree: dict, abstract_params):
    """Wraps load(abstract_params) -> params, which reads load_parameters_path's checkpoint (its metadata: tree).
    The params it gives may lack some of abstract_params' leaves: those start from the init."""
    del tree
    return load(abstract_params)

  def batch_shapes(self, shapes: dict) -> dict:
    """The train step's batch as {key: (shape, dtype)}, with what this feature's host_batch changes (compiling the
    step ahead of time traces it on these)."""
    return shapes

  def host_batch(self, state, pull: Callable[[], dict], model, mesh):
    """Before each train step, on the host: returns (state, pull'), where pull'() gives the batch the step trains on.

    pull() gives the data's next batch (or the batch of the features before this one). A feature that makes its own
    batches calls it when it needs the data (GRPO: the prompts it generates completions of, every num_iterations
    steps) and keeps what the steps between need in its slots, which checkpoints hold. model and mesh are the run's
    (to generate with). Default: the batch as it comes.
    """
    del model, mesh
    return state, pull

  def observers(self, config, params, writer, start_step: int) -> list:
    """Callables (step, scalars, nested) that the metric logger calls with each written step."""
    del config, params, writer, start_step
    return []


_CHECKPOINT_HINTS: list[Callable[[set, set], str]] = []


def register_checkpoint_hint(hint: Callable[[set, set], str]) -> None:
  """Adds hint(saved, wanted) -> text ('' for none), said when a checkpoint's params (saved: their '/'-joined paths)
  differ from the model's (wanted). A feature module registers its own when it is imported (features/selection.py
  imports all of them), so the hint is said also where the run has that feature off: e.g. which key makes the params
  that the checkpoint holds and the model lacks."""
  _CHECKPOINT_HINTS.append(hint)


_RESTORE_CHECKS: list[Callable] = []


def register_restore_check(check: Callable) -> None:
  """Adds check(tree, abstract_state, where), which raises a UserError when a checkpoint (its metadata tree) holds a
  feature's state that this run, without that feature, cannot take. Registered when the feature module is imported,
  so it speaks where the run has the feature off (Feature.check_restore speaks where it is on)."""
  _RESTORE_CHECKS.append(check)


def restore_checks(tree: dict, abstract_state, where: str) -> None:
  for check in _RESTORE_CHECKS:
    check(tree, abstract_state, where)


def checkpoint_hints(saved: set, wanted: set) -> str:
  """The registered hints' texts for these params, joined."""
  return "; ".join(text for hint in _CHECKPOINT_HINTS if (text := hint(saved, wanted)))


def collections(features, inputs: dict) -> dict:
  """The model variable collections the features' step inputs feed."""
  out = {}
  for feature in features:
    out.update(feature.collections(inputs[feature.name]))
  return out


def host_batch(features, state, pull: Callable[[], dict], model, mesh):
  """(state, the batch of the step): each feature's host_batch in order, then the batch pulled."""
  for feature in features:
    state, pull = feature.host_batch(state, pull, model, mesh)
  return state, pull()


def parameter_count(features, params) -> int:
  """The model's parameters, as the features count them (counted_params)."""
  return sum(x.size for x in jax.tree.leaves(apply_all(features, "counted_params", params)))


def describe_parameters(features, params) -> str:
  """The run log's parameter count, with the features' clauses (size_note)."""
  total = parameter_count(features, params)
  return f"{total / 1e9:.6f} billion ({total:,})" + "".join(f.size_note(params, total) for f in features)


def apply_all(features, hook: str, value, *args):
  """value passed through each feature's `hook` in order: hook(value, *args) -> value."""
  for feature in features:
    value = getattr(feature, hook)(value, *args)
  return value


def apply_all_reversed(features, hook: str, value):
  """As apply_all, last feature first: the inverse of a chain that apply_all built."""
  for feature in reversed(features):
    value = getattr(feature, hook)(value)
  return value


def is_frozen(features, leaf) -> bool:
  return any(feature.frozen(leaf) for feature in features)
