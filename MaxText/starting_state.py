"""The state a run starts from (and, when it resumes its own checkpoint, the data position saved with it).

In order: the run's own latest good checkpoint (with LoRA: its adapters, joined onto the base); load_full_state_path
(params, optimizer state and step; with LoRA a LoRA run's, joined onto load_parameters_path's base);
load_parameters_path (a fresh state with those params; with LoRA the base, and the adapters too when the checkpoint
holds some); a fresh init. checkpointing.py reads and checks each.
"""

import orbax.checkpoint as ocp

from MaxText import checkpointing, lora_training, max_logging, qlora_loading, single_replica_restore
from MaxText.errors import UserError
from MaxText.layers import qlora


def load_full_state(path: str, abstract_state):
  """A whole TrainState (params, optimizer state, step) from an Orbax checkpoint's items directory; with LoRA
  (adapters in abstract_state) a LoRA run's, which holds the adapters only (lora_training.adapters_only)."""
  tree = checkpointing.tree_metadata(path, "load_full_state_path")
  if "opt_state" not in tree:
    raise UserError(f"load_full_state_path={path} holds params only (no optimizer state); use load_parameters_path")
  lora_run, lora_state = (bool(lora_training.split(t)[1]) for t in (abstract_state.params, tree["params"]))
  if lora_run and not lora_state:
    raise UserError(
      f"load_full_state_path={path} is the train state of a run without LoRA; with enable_lora=true give a LoRA "
      "run's checkpoint, or that model's params as load_parameters_path"
    )
  if lora_state and not lora_run:
    raise UserError(
      f"load_full_state_path={path} holds a LoRA run's adapters and their optimizer state: set enable_lora=true "
      "(and its lora_* keys), with the base model as load_parameters_path"
    )
  checkpointing.check_checkpoint_fits(tree["params"], abstract_state.params, path)
  checkpointing.check_quantization_state(tree, abstract_state, path, path)
  try:
    state = ocp.StandardCheckpointer().restore(path, abstract_state)
  except Exception as e:  # pylint: disable=broad-except  # e.g. another optimizer's state
    raise UserError(
      f"load_full_state_path={path} does not fit this run's train state: {checkpointing.short_error(e)}"
    ) from None
  max_logging.log(f"Loaded the full train state (step {int(state.step)}) from {path}")
  return state


def load_parameters(config, abstract_params) -> tuple[dict, dict]:
  """load_parameters_path's params as (base, adapters). The adapters are {} unless the run has LoRA on and the
  checkpoint holds some (a PEFT adapter read in by convert_checkpoint.py to_maxtext --peft_adapter)."""
  path = config.load_parameters_path
  tree = checkpointing.tree_metadata(path, "load_parameters_path")
  quantized = config.enable_lora and config.lora_weight_qtype  # QLoRA: the checkpoint's float kernels, quantized
  wanted = qlora.float_layout(abstract_params, config.weight_dtype) if quantized else abstract_params
  if not lora_training.split(tree["params"])[1]:
    wanted = lora_training.split(wanted)[0]  # the adapters start afresh
  if quantized:
    loaded = qlora_loading.load(path, tree, wanted, abstract_params, config.param_scan_axis)
  else:
    loaded = checkpointing.load_params(path, wanted, config.param_scan_axis)
  return lora_training.split(loaded)


def _base_params(config, abstract_state, init_fn):
  """The params other than LoRA's adapters (all of them without LoRA): load_parameters_path's, else a fresh init's
  (the same for a given init_weights_seed)."""
  if config.load_parameters_path:
    return load_parameters(config, abstract_state.params)[0]
  return lora_training.split(init_fn().params)[0]


def onto_base(config, abstract_state, init_fn, restored):
  """A checkpoint's (state, data position) restored in lora_training.adapters_only's layout, with the frozen base
  joined back (load_parameters_path's, else the init's); a whole state as is."""
  state, data_state = restored
  if lora_training.split(state.params)[0]:
    return restored
  base = _base_params(config, abstract_state, init_fn)
  return state.replace(params=lora_training.join(base, state.params)), data_state


def initial_state(config, manager, abstract_state, init_fn):
  """The state to start from, and the data iterator state to resume (None: start the data afresh).

  In order: this run's latest good checkpoint; load_full_state_path; load_parameters_path (a fresh state with those
  params); init_fn() (a fresh state).
  """
  if manager is not None:
    tier = "the persistent tier " if config.enable_emergency_checkpoint else ""
    saved = lora_training.adapters_only(abstract_state)  # a LoRA run saves its adapters, not the frozen base
    reader = single_replica_restore.reader(
      config, saved, checkpointing.STATE_ITEM, {checkpointing.DATA_ITEM: checkpointing.DataIteratorHandler()}
    )
    restored = checkpointing.restore_latest(manager, saved, tier, reader)
    if restored is not None:
      return onto_base(config, abstract_state, init_fn, restored)
  if config.load_full_state_path:  # with LoRA, onto load_parameters_path's base
    saved = lora_training.adapters_only(abstract_state)
    return onto_base(config, abstract_state, init_fn, (load_full_state(config.load_full_state_path, saved), None))
  if config.load_parameters_path:
    state = init_fn()
    base, adapters = load_parameters(config, abstract_state.params)
    return state.replace(params=lora_training.join(base, adapters or lora_training.split(state.params)[1])), None
  return init_fn(), None
