"""The state a run starts from (and, when it resumes its own checkpoint, the data position saved with it).

In order: the run's own latest good checkpoint; load_full_state_path (params, optimizer state and step);
load_parameters_path (a fresh state with those params); a fresh init. A checkpoint holds what the features' `saved`
keep of the state: params it lacks (a run that trains adapters saves them, not the frozen base) come from
load_parameters_path again, else from the init. checkpointing.py reads and checks each.
"""

import jax
import orbax.checkpoint as ocp

from MaxText import feature_protocol, max_logging
from MaxText.checkpoints import checkpointing, single_replica_restore
from MaxText.errors import UserError
from MaxText.layers import layer_names
from MaxText.training import train_state


def checks(features):
  """check(tree, abstract_state, where): the core's and the features' checks that a checkpoint restores here."""

  def check(tree: dict, abstract_state, where: str) -> None:
    feature_protocol.restore_checks(tree, abstract_state, where)  # first: a feature's line says more than a list
    for feature in features:
      feature.check_restore(tree, abstract_state, where)
    checkpointing.check_checkpoint_fits(tree["params"], abstract_state.params, where)
    checkpointing.check_state_slots(tree, abstract_state, where)

  return check


def load_full_state(path: str, features, abstract_state):
  """A whole train state (params, optimizer state, step, slots) from an Orbax checkpoint's items directory, in the
  features' saved form (train_state.saved)."""
  tree = checkpointing.tree_metadata(path, "load_full_state_path")
  if "opt_state" not in tree:
    raise UserError(f"load_full_state_path={path} holds params only (no optimizer state); use load_parameters_path")
  checks(features)(tree, abstract_state, f"load_full_state_path={path}")
  try:
    state = ocp.StandardCheckpointer().restore(path, abstract_state)
  except Exception as e:  # pylint: disable=broad-except  # e.g. another optimizer's state
    raise UserError(
      f"load_full_state_path={path} does not fit this run's train state: {checkpointing.short_error(e)}"
    ) from None
  max_logging.log(f"Loaded the full train state (step {int(state.step)}) from {path}")
  return state


def load_parameters(config, features, abstract_params) -> dict:
  """load_parameters_path's params, read as the features say (e.g. quantized as they are read).
  They may lack some of abstract_params' leaves (adapters the checkpoint does not hold): those start from
  the init."""
  path = config.load_parameters_path
  tree = checkpointing.tree_metadata(path, "load_parameters_path")

  def load(wanted):
    return checkpointing.load_params(path, wanted, config.param_scan_axis)

  for feature in reversed(features):  # the first feature's wrapper outermost
    load = _wrapped(feature, load, tree)
  return load(abstract_params)


def _wrapped(feature, load, tree):
  return lambda wanted: feature.load_params(load, tree, wanted)


def _is_whole(params, abstract_params) -> bool:
  return len(jax.tree.leaves(params)) == len(jax.tree.leaves(abstract_params))


def onto_base(config, features, abstract_state, init_fn, restored):
  """A checkpoint's (state, data position) with the params it does not hold (the features' `saved` left them out)
  joined back: load_parameters_path's, else the init's. A whole state as is."""
  state, data_state = restored
  if _is_whole(state.params, abstract_state.params):
    return restored
  base = load_parameters(config, features, abstract_state.params) if config.load_parameters_path else {}
  if not _is_whole(base, abstract_state.params):
    base = layer_names.merge(init_fn().params, base)  # a frozen base, without load_parameters_path
  return state.replace(params=layer_names.merge(base, state.params)), data_state


def initial_state(config, features, manager, abstract_state, init_fn):
  """The state to start from, and the data iterator state to resume (None: start the data afresh).

  In order: this run's latest good checkpoint; load_full_state_path; load_parameters_path (a fresh state with those
  params); init_fn() (a fresh state).
  """
  saved = train_state.saved(features, abstract_state)
  if manager is not None:
    tier = "the persistent tier " if config.enable_emergency_checkpoint else ""
    reader = single_replica_restore.reader(
      config, saved, checkpointing.STATE_ITEM, {checkpointing.DATA_ITEM: checkpointing.DataIteratorHandler()}
    )
    restored = checkpointing.restore_latest(manager, saved, tier, reader, checks(features))
    if restored is not None:
      return onto_base(config, features, abstract_state, init_fn, restored)
  if config.load_full_state_path:
    state = load_full_state(config.load_full_state_path, features, saved)
    return onto_base(config, features, abstract_state, init_fn, (state, None))
  if config.load_parameters_path:
    state = init_fn()
    params = load_parameters(config, features, abstract_state.params)
    return state.replace(params=layer_names.merge(state.params, params)), None
  return init_fn(), None


def start(features, state):
  """The state the loop starts from: each feature's on_start applied (e.g. a copy taken at step 0)."""
  return feature_protocol.apply_all(features, "on_start", state)
