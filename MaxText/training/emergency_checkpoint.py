"""Emergency (multi-tier) checkpoints: frequent saves to each host's local disk, rarer ones to persistent storage.

enable_emergency_checkpoint=true adds a local tier: every local_checkpoint_period steps each process writes its own
shards of the train state, and its data position, to <local_checkpoint_directory>/<run_name>/process_<i>-of-<n>
(a RAM disk or local SSD). The persistent tier is the run's checkpoint directory, saved every checkpoint_period steps
as without the option. A local save is Orbax's CheckpointManager with the per-process options of Orbax's own
emergency local manager (no primary host, no barrier across processes, every addressable shard written), so it costs
no network traffic and works with any number of data-parallel replicas, one included.

On restart the processes agree on the newest step that every one of them holds locally. If it is newer than the
newest persistent checkpoint, each restores its own shards and data position from its own disk; otherwise (or if a
local copy turns out unreadable) the run restores the persistent tier.

Orbax's emergency CheckpointManager (orbax.checkpoint.experimental.emergency) is not used: it keeps local copies on
non-primary replicas only (so none with one replica), and no data-iterator state in the local tier, which an exact
resume needs. What it adds, restoring from a peer replica's local copy by broadcast, is therefore not done here: a
host that lost its local copy makes the run restore the newest persistent checkpoint.
"""

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from orbax.checkpoint import type_handlers

from MaxText import max_logging
from MaxText.checkpoints import checkpointing
from MaxText.training import starting_state, train_state

_AGREED_STEPS = 16  # the newest local steps each process offers when the processes agree on one


def _own_shards_handler(multiprocessing: ocp.options.MultiprocessingOptions) -> ocp.PyTreeCheckpointHandler:
  """Writes and reads every addressable shard of each array (replica_id=None), with no primary host."""
  registry = type_handlers.create_type_handler_registry(
    (jax.Array, type_handlers.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False))
  )
  return ocp.PyTreeCheckpointHandler(
    use_ocdbt=True, use_zarr3=True, multiprocessing_options=multiprocessing, type_handler_registry=registry
  )


class LocalTier:
  """This process's local checkpoints: its shards and its data position, every local_checkpoint_period steps."""

  def __init__(self, config):
    process, count = jax.process_index(), jax.process_count()
    self.period = config.local_checkpoint_period
    self.directory = epath.Path(config.local_checkpoint_directory) / config.run_name / f"process_{process}-of-{count}"
    self.directory.mkdir(parents=True, exist_ok=True)  # Orbax creates no root directory for a subset of processes
    multiprocessing = ocp.options.MultiprocessingOptions(
      primary_host=None, active_processes={process}, barrier_sync_key_prefix=f"local-{process}"
    )
    options = ocp.CheckpointManagerOptions(
      save_interval_steps=1,  # the loop decides (due)
      max_to_keep=2,  # a save in flight never replaces the newest complete one
      multiprocessing_options=multiprocessing,
      create=False,
      cleanup_tmp_directories=True,  # a save killed mid-write leaves a tmp dir, never a step dir
      enable_async_checkpointing=config.async_checkpointing,
      save_root_metadata=False,
      enable_per_process_directory_creation=True,
    )
    handlers = {
      checkpointing.STATE_ITEM: _own_shards_handler(multiprocessing),
      checkpointing.DATA_ITEM: checkpointing.DataIteratorHandler(),
    }
    self.manager = ocp.CheckpointManager(self.directory, item_handlers=handlers, options=options)

  def due(self, step: int) -> bool:
    return step % self.period == 0

  def save(self, step: int, state, data_iterator, dataset_type: str) -> None:
    data_state = checkpointing.data_position(data_iterator, dataset_type)
    args = {
      checkpointing.STATE_ITEM: ocp.args.PyTreeSave(state),
      checkpointing.DATA_ITEM: checkpointing.DataIteratorSave(data_state),
    }
    self.manager.save(step, args=ocp.args.Composite(**args), force=True)

  def restore(self, step: int, abstract_state):
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_state)
    args = {
      checkpointing.STATE_ITEM: ocp.args.PyTreeRestore(item=abstract_state, restore_args=restore_args),
      checkpointing.DATA_ITEM: checkpointing.DataIteratorRestore(),
    }
    restored = self.manager.restore(step, args=ocp.args.Composite(**args))
    return restored[checkpointing.STATE_ITEM], restored[checkpointing.DATA_ITEM]

  def drop_newer_than(self, step: int) -> None:
    """Deletes this process's local steps after `step`: those of a timeline the run did not resume (it restored an
    older step), which its next saves would otherwise collide with."""
    for newer in [s for s in self.manager.all_steps() if s > step]:
      self.manager.delete(newer)

  def wait_until_finished(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()


def create(config) -> LocalTier | None:
  """The local tier when enable_emergency_checkpoint (and checkpointing) is on, else None."""
  if not (config.enable_checkpointing and config.enable_emergency_checkpoint):
    return None
  tier = LocalTier(config)
  max_logging.log(
    f"Emergency checkpoints: every {tier.period} steps to the local tier {tier.directory}, every "
    f"{config.checkpoint_period} steps to the persistent tier {config.checkpoint_dir}"
  )
  return tier


def newest_step_on_every_process(steps) -> int | None:
  """The newest of `steps` (this process's) that every process also has, or None."""
  offered = np.full(_AGREED_STEPS, -1, np.int64)
  newest = sorted(steps, reverse=True)[:_AGREED_STEPS]
  offered[: len(newest)] = newest
  gathered = np.asarray(multihost_utils.process_allgather(offered)).reshape(-1, _AGREED_STEPS)
  common = set.intersection(*({int(s) for s in row if s >= 0} for row in gathered))
  return max(common) if common else None


def restore_local(tier: LocalTier, persistent_step: int | None, abstract_state):
  """(state, data position) from the local tier when every process holds a step newer than the persistent tier's
  newest (persistent_step), else None. A local copy that fails to read on any process is skipped with a warning."""
  step = newest_step_on_every_process(tier.manager.all_steps())
  if step is None or (persistent_step is not None and step <= persistent_step):
    return None
  error = None
  try:
    restored = tier.restore(step, abstract_state)
  except Exception as e:  # pylint: disable=broad-except  # the persistent tier is the fallback
    error = e
  if not checkpointing.on_every_process(error is None):
    reason = f"{type(error).__name__}: {error}" if error else "it failed on another process"
    max_logging.warn(f"could not restore step {step} from the local tier ({reason}); restoring the persistent tier")
    return None
  max_logging.log(f"Restored the checkpoint of step {step} from the local tier {tier.directory}")
  return restored


def initial_state(config, features, manager, tier: LocalTier | None, abstract_state, init_fn):
  """starting_state.initial_state, preceded by the local tier when every process holds a step newer than the
  persistent tier's newest. The local tier holds what the persistent one does (train_state.saved)."""
  restored = None
  if tier is not None:
    saved = train_state.saved(features, abstract_state)
    restored = restore_local(tier, checkpointing.newest_complete_step(config.checkpoint_dir), saved)
    if restored is not None:
      restored = starting_state.onto_base(config, features, abstract_state, init_fn, restored)
  if restored is None:
    restored = starting_state.initial_state(config, features, manager, abstract_state, init_fn)
  if tier is not None:
    tier.drop_newer_than(int(restored[0].step) - 1)  # the step restored (the state holds the next one)
  return restored
