"""Orbax checkpoints of the train state and of the data iterator's position: the manager, save, and restore with
its checks.

Layout: <checkpoint_dir>/<N>/items (the TrainState after step N, so a restored run continues at N+1)
and <checkpoint_dir>/<N>/data_iter (one JSON file per process). Which of them, or which other checkpoint, a run
starts from is starting_state.py's.
"""

import contextlib
import dataclasses
import json
import logging
import re
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from MaxText import feature_protocol, max_logging
from MaxText.checkpoints import checkpoint_loggers, disk_full, params_layout, single_replica_restore
from MaxText.errors import UserError
from MaxText.input_pipeline.batching import merge_process_states
from MaxText.runtime import fault_injection

STATE_ITEM = "items"
DATA_ITEM = "data_iter"
QUARANTINE_DIR = "corrupted_checkpoints"
_MAX_LISTED_MISMATCHES = 5
_TREE_METADATA_FILE = "_METADATA"  # Orbax's metadata of an items directory (the tree, its shapes and dtypes)
# How a checkpoint read went, worst last: every process takes the branch of the worst verdict.
_OK, _DAMAGED, _UNREADABLE = 0, 1, 2
# Tensorstore (the array reads) reports errors as ValueError("<STATUS>: ..."); these statuses mean bad or missing bytes.
_DAMAGE_STATUSES = ("NOT_FOUND", "DATA_LOSS", "OUT_OF_RANGE", "FAILED_PRECONDITION", "INVALID_ARGUMENT")
_TENSORSTORE_STATUSES = _DAMAGE_STATUSES + (
  "PERMISSION_DENIED",
  "UNAUTHENTICATED",
  "UNAVAILABLE",
  "DEADLINE_EXCEEDED",
  "RESOURCE_EXHAUSTED",
  "ABORTED",
  "CANCELLED",
  "INTERNAL",
  "UNKNOWN",
  "UNIMPLEMENTED",
  "ALREADY_EXISTS",
)


class DataIteratorHandler(ocp.CheckpointHandler):
  """Saves each process's data-iterator state as JSON. A process restores its own file, except that the
  positions keyed by global row ("rows", random-access pipelines) or by data shard ("shards", streamed
  ones) are unioned over all files, so that those resume with any number of processes."""

  def save(self, directory: epath.Path, args: "DataIteratorSave"):
    name = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
    (directory / name).write_text(json.dumps(args.state))

  def restore(self, directory: epath.Path, args: "DataIteratorRestore" = None) -> dict:
    del args
    states = {path.name: json.loads(path.read_text()) for path in sorted(directory.glob("process_*.json"))}
    if not states:
      raise FileNotFoundError(f"no process_*.json in {directory}")
    own = states.get(f"process_{jax.process_index()}-of-{jax.process_count()}.json", next(iter(states.values())))
    return merge_process_states(own, list(states.values()))


@ocp.args.register_with_handler(DataIteratorHandler, for_save=True)
@dataclasses.dataclass
class DataIteratorSave(ocp.args.CheckpointArgs):
  state: dict


@ocp.args.register_with_handler(DataIteratorHandler, for_restore=True)
@dataclasses.dataclass
class DataIteratorRestore(ocp.args.CheckpointArgs):
  pass


def create_checkpoint_manager(config) -> ocp.CheckpointManager | None:
  if not config.enable_checkpointing:
    max_logging.log("Checkpointing is disabled (enable_checkpointing=false).")
    return None
  disk_full.quiet_library_reports()  # a full disk is one line, not the library's report of each failed write
  options = ocp.CheckpointManagerOptions(
    save_interval_steps=1,  # train.py decides when to save (period, last step, preemption)
    max_to_keep=config.max_num_checkpoints_to_keep,
    enable_async_checkpointing=config.async_checkpointing,
    create=True,
    cleanup_tmp_directories=True,  # a save killed mid-write leaves a tmp dir, never a step dir
  )
  handlers = {STATE_ITEM: ocp.StandardCheckpointHandler(), DATA_ITEM: DataIteratorHandler()}
  logger = checkpoint_loggers.create(config)
  return ocp.CheckpointManager(config.checkpoint_dir, item_handlers=handlers, options=options, logger=logger)


def _flat_shapes(tree, prefix: str) -> dict[str, tuple]:
  """{'params/decoder/layers/mlp/wo/kernel': shape} for array leaves of a (metadata or abstract) tree."""
  flat = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if hasattr(leaf, "shape"):
      keys = [prefix] + [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
      flat["/".join(keys)] = tuple(leaf.shape)
  return flat


def check_checkpoint_fits(checkpoint_params, model_params, where: str) -> None:
  """Raises a UserError naming the first parameters whose presence or shape differ."""
  saved, wanted = _flat_shapes(checkpoint_params, "params"), _flat_shapes(model_params, "params")
  problems = [f"{k}: checkpoint {saved[k]} vs model {wanted[k]}" for k in wanted if k in saved and saved[k] != wanted[k]]
  problems += [f"{k}: in the model, not in the checkpoint" for k in wanted if k not in saved]
  problems += [f"{k}: in the checkpoint, not in the model" for k in saved if k not in wanted]
  if problems:
    more = f"; and {len(problems) - _MAX_LISTED_MISMATCHES} more" if len(problems) > _MAX_LISTED_MISMATCHES else ""
    hints = feature_protocol.checkpoint_hints(set(saved), set(wanted))
    hint = f" ({hints})" if hints else ""
    raise UserError(
      f"checkpoint {where} does not fit the model (other dims, layer count or scan_layers?){hint}: "
      + "; ".join(problems[:_MAX_LISTED_MISMATCHES])
      + more
    )


def check_state_slots(tree, abstract_state, where: str) -> None:
  """Raises a UserError when a checkpoint holds a train state slot that this run does not keep (a feature's state,
  named by its slot); the features check the slots they need themselves (check_restore)."""
  extra = sorted(set(tree) - {"step", "params", "opt_state"} - set(getattr(abstract_state, "slots", {})))
  if extra:
    items = where if where.endswith(f"/{STATE_ITEM}") else f"{where}/{STATE_ITEM}"
    raise UserError(
      f"checkpoint {where} holds the train state of a feature this run does not use ({', '.join(extra)}): resume "
      f"with the features it was trained with, or start a new run_name from its params (load_parameters_path={items})"
    )


def on_every_process(ok: bool) -> bool:
  """True when `ok` holds on every process (so that all take the same branch)."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  return bool(np.all(multihost_utils.process_allgather(np.array(ok))))


def _worst_on_any_process(verdict: int) -> int:
  """The highest verdict over all processes (so that all take the same branch)."""
  if jax.process_count() == 1:
    return verdict
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  return int(np.max(multihost_utils.process_allgather(np.array(verdict))))


def _status_code(error: BaseException) -> str | None:
  """The status of a tensorstore error (a ValueError reading "NOT_FOUND: ..."), or None."""
  match = re.match(r"([A-Z_]+): ", str(error))
  return match.group(1) if isinstance(error, ValueError) and match and match.group(1) in _TENSORSTORE_STATUSES else None


def _error_kind(error: BaseException) -> str | None:
  """What a checkpoint read error shows: "damaged" (files missing or malformed), "access" (permissions, I/O or
  network errors, storage 5xx or throttling: the files may be fine), or None (unknown). Follows the chain of causes."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
      return "damaged"
    if isinstance(error, OSError):
      return "access"
    if isinstance(error, (json.JSONDecodeError, UnicodeDecodeError, EOFError)):
      return "damaged"
    if type(error).__module__.startswith("msgpack"):
      return "damaged"  # msgpack's decode errors
    status = _status_code(error)
    if status is not None:
      return "damaged" if status in _DAMAGE_STATUSES else "access"
    http_status = getattr(error, "code", None)  # google.api_core / HTTP client errors carry the HTTP status
    if isinstance(http_status, int) and 400 <= http_status < 600:
      return "damaged" if http_status == 404 else "access"
    error = error.__cause__ or error.__context__
  return None


def _verdict(error: Exception | None) -> int:
  """_OK, _DAMAGED (only when the error shows damage) or _UNREADABLE (any other error: move nothing)."""
  if error is None:
    return _OK
  return _DAMAGED if _error_kind(error) == "damaged" else _UNREADABLE


def _quarantine(manager, step: int, reason: str) -> None:
  """Moves an unreadable checkpoint out of the way (kept for inspection, never deleted)."""
  source = epath.Path(manager.directory) / str(step)
  target = epath.Path(manager.directory).parent / QUARANTINE_DIR / f"{step}-{int(time.time())}"
  max_logging.warn(f"checkpoint of step {step} at {source} is unreadable ({reason}); moving it to {target}")
  if jax.process_index() == 0:
    target.parent.mkdir(parents=True, exist_ok=True)
    source.rename(target)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    multihost_utils.sync_global_devices(f"quarantine checkpoint {step}")
  manager.reload()


def short_error(error: Exception) -> str:
  """An error as one line of at most 300 characters, its type first."""
  return " ".join(f"{type(error).__name__}: {error}".split())[:300]


def tree_metadata(path, key: str) -> dict:
  """The array-metadata tree of an Orbax PyTree checkpoint, or a UserError naming the key that pointed at it."""
  if not epath.Path(path).exists():
    converted = epath.Path(path).parent.parent / "params"  # upstream's converters wrote OUT/0/items
    if epath.Path(path).name == "items" and epath.Path(path).parent.name.isdigit() and converted.exists():
      raise UserError(
        f"{key}={path} does not exist; convert_checkpoint.py writes its params to {converted} (upstream's converters "
        f"wrote OUT/0/items): {key}={converted}"
      )
    raise UserError(f"{key}={path} does not exist")
  try:
    with _quiet_item_read():
      metadata = ocp.PyTreeCheckpointer().metadata(path)
    tree = metadata.item_metadata.tree
  except Exception as e:  # pylint: disable=broad-except  # not a checkpoint at all, or a damaged one
    raise UserError(
      f"{key}={path} is not an Orbax checkpoint's items directory (e.g. <run>/checkpoints/<N>/items): {short_error(e)}"
    ) from None
  if not isinstance(tree, dict) or "params" not in tree:
    keys = ", ".join(tree) if isinstance(tree, dict) else type(tree).__name__
    raise UserError(f"{key}={path} holds no 'params' (it holds: {keys})")
  return tree


def _readable_on_host(step_dir: str, tree) -> Exception | None:
  """Why a checkpoint whose restore failed does not read back, array by array, as host arrays (None: it does).

  One array at a time, so that even a large model's check fits in host memory. `tree` is the items' metadata tree.
  """
  try:
    path = epath.Path(step_dir) / STATE_ITEM
    checkpointer = ocp.PyTreeCheckpointer()
    as_numpy = ocp.RestoreArgs(restore_type=np.ndarray)
    for wanted, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
      item = jax.tree_util.tree_map_with_path(lambda p, leaf, w=wanted: leaf if p == w else ocp.PLACEHOLDER, tree)
      args = jax.tree_util.tree_map_with_path(lambda p, _, w=wanted: as_numpy if p == w else ocp.PLACEHOLDER, tree)
      checkpointer.restore(path, args=ocp.args.PyTreeRestore(item=item, restore_args=args))
    DataIteratorHandler().restore(epath.Path(step_dir) / DATA_ITEM)
    return None
  except Exception as e:  # pylint: disable=broad-except
    return e


def _saved_tree(manager, step: int):
  """The metadata tree of a checkpoint's train state (its array shapes), without reading any array."""
  try:
    saved = manager.item_metadata(step)[STATE_ITEM]
  except KeyError:  # Orbax: "Unknown key: items", its directory is absent or cannot be listed
    saved = None
  if saved is None:
    # Orbax reports a missing and an inaccessible metadata file alike (as absent): reading it here raises
    # the error that tells them apart (FileNotFoundError vs PermissionError, a storage error, ...).
    metadata_file = epath.Path(manager.directory) / str(step) / STATE_ITEM / _TREE_METADATA_FILE
    metadata_file.read_bytes()
    raise RuntimeError(f"Orbax finds no train state metadata although {metadata_file} is readable")
  return saved.tree


def _why_restore_failed(where: str, tree, error: Exception | None) -> tuple[int, str]:
  """After a restore that failed on some process: (the verdict every process shares, this process's reason).

  Process 0 reads the files back as plain arrays: that tells a damaged checkpoint (_DAMAGED) from one that
  cannot be read right now (_UNREADABLE) and from one that is intact but does not fit this run (_OK).
  """
  reason = short_error(error) if error else "failed on another process"
  verdict = _OK
  if jax.process_index() == 0:
    host_error = _readable_on_host(where, tree)
    verdict = _verdict(host_error)
    reason = short_error(host_error) if host_error else reason
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    verdict = int(multihost_utils.broadcast_one_to_all(np.array(verdict)))
  if verdict == _OK and error is not None and _error_kind(error) == "access":
    verdict = _UNREADABLE  # the arrays read back on process 0, but this process cannot read them
  return verdict, reason


def _unreadable(where: str, reason: str) -> UserError:
  return UserError(
    f"cannot read the checkpoint {where} ({reason}); this does not show that it is damaged, so nothing was moved: "
    "fix the access and rerun (or move it aside yourself to resume from the previous checkpoint)"
  )


def restore_latest(manager, abstract_state, tier: str = "", reader=None, check=None):
  """The newest readable checkpoint of this run: (state, data_iterator_state or None), or None if there is none.

  A checkpoint shown to be damaged (a truncated, undecodable or missing file) is reported, moved aside,
  and the previous one is tried; any other read error (permissions, I/O, storage or network errors) stops
  the run with a UserError and moves nothing. Every process takes the same decision. A checkpoint of another
  model, or an intact one that cannot be restored onto this run, is a UserError (no silent fallback).

  Args:
    check: check(tree, abstract_state, where) raises a UserError when the checkpoint (its metadata tree) cannot
      restore into abstract_state (starting_state.checks); default: its params must fit.
  """
  damaged = False
  for step in sorted(manager.all_steps(), reverse=True):
    where = str(epath.Path(manager.directory) / str(step))
    error = None
    try:
      tree = _saved_tree(manager, step)
      saved_params = tree["params"]
    except Exception as e:  # pylint: disable=broad-except  # classified below: damaged, or unreadable for now
      error = e
    verdict = _worst_on_any_process(_verdict(error))
    if verdict == _UNREADABLE:
      raise _unreadable(where, short_error(error) if error else "the read failed on another process")
    if verdict == _DAMAGED:
      _quarantine(manager, step, short_error(error) if error else "unreadable on another process")
      damaged = True
      continue
    if check is None:
      check_checkpoint_fits(saved_params, abstract_state.params, where)
    else:
      check(tree, abstract_state, where)
    try:
      restored = _restore(manager, step, abstract_state, reader)
    except Exception as e:  # pylint: disable=broad-except
      error = e
    if on_every_process(error is None):
      max_logging.log(f"Restored the checkpoint of step {step} from {tier}{where}")
      return restored[STATE_ITEM], restored[DATA_ITEM]
    verdict, reason = _why_restore_failed(where, tree, error)
    if verdict == _OK:
      raise UserError(f"checkpoint {where} is intact but cannot be restored onto this run: {reason}")
    if verdict == _UNREADABLE:
      raise _unreadable(where, reason)
    _quarantine(manager, step, reason)
    damaged = True
  if damaged:
    # Never start from scratch silently over a run whose every checkpoint failed to load.
    quarantined = epath.Path(manager.directory).parent / QUARANTINE_DIR
    raise UserError(f"no checkpoint of this run could be read; they were moved to {quarantined} (see the warnings above)")
  return None


def _restore(manager, step: int, abstract_state, reader=None):
  """The items of step `step`: with the manager's handlers, or through reader (single_replica_restore.reader)."""
  if reader is not None:
    state_args = ocp.args.PyTreeRestore(
      item=abstract_state, restore_args=single_replica_restore.restore_args(abstract_state)
    )
    restored = reader.restore(step, args=ocp.args.Composite(**{STATE_ITEM: state_args, DATA_ITEM: DataIteratorRestore()}))
  else:
    args = {STATE_ITEM: ocp.args.StandardRestore(abstract_state), DATA_ITEM: DataIteratorRestore()}
    restored = manager.restore(step, args=ocp.args.Composite(**args))
  return restored


class _WithoutStepMetadataWarning(logging.Filter):
  """Orbax warns that an items directory has no step metadata, which only the step directory above it holds."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "Metadata file does not exist" not in record.getMessage()


@contextlib.contextmanager
def _quiet_item_read():
  absl_logger, quiet = logging.getLogger("absl"), _WithoutStepMetadataWarning()
  absl_logger.addFilter(quiet)
  try:
    yield
  finally:
    absl_logger.removeFilter(quiet)


def load_params(path: str, abstract_params, scan_axis: int = 1, key: str = "load_parameters_path"):
  """Params from an Orbax PyTree holding {"params": ...} (a training checkpoint's items, or params-only).

  The checkpoint's layers may be scanned (`layers`) or per-layer (`layers_i`) whatever the layout of
  `abstract_params` (params_layout restacks them on the devices); scan_axis is the run's param_scan_axis.
  `key` is the config key that named the path (for error messages).
  """
  tree = tree_metadata(path, key)
  saved_layout = params_layout.saved_layout(tree["params"], abstract_params, scan_axis)
  check_checkpoint_fits(tree["params"], saved_layout, path)
  restored = restore_params(path, saved_layout)
  max_logging.log(f"Loaded parameters from {path}")
  return params_layout.to_run_layout(restored, abstract_params, scan_axis)


def restore_params(path: str, target_params):
  """The params that target_params (abstract arrays in the checkpoint's layout: all of its params or some) names."""
  target = {"params": target_params}
  restore_args = ocp.checkpoint_utils.construct_restore_args(target)
  with _quiet_item_read():
    restored = ocp.PyTreeCheckpointer().restore(
      path, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True)
    )
  return restored["params"]


def restore_data_position(config, data_iterator, data_state) -> None:
  """Puts the data iterator where the checkpoint's data was, or, with data_position_on_resume=reset, leaves it at
  the start (another dataset_type, or a Hugging Face stream on another number of data shards: what resumes then is
  the model and the optimizer). TFRecord streams re-split onto another number of data shards themselves
  (input_pipeline/tfds_resplit.py)."""
  if config.data_position_on_resume == "reset":
    max_logging.log(
      "data_position_on_resume=reset: the model and optimizer are restored; the data position is not, so "
      "the data starts afresh"
    )
    return
  saved_type = data_state.get("dataset_type", config.dataset_type)  # checkpoints before it was saved: not checked
  if saved_type != config.dataset_type:
    raise UserError(
      f"the checkpoint's data position is for dataset_type={saved_type}, this run reads dataset_type="
      f"{config.dataset_type}: resume with the dataset_type the run was started with, or data_position_on_resume=reset "
      "restores the model and optimizer and starts the data afresh"
    )
  try:
    data_iterator.set_state(data_state)
  except UserError as error:
    raise UserError(
      f"{error}; or data_position_on_resume=reset restores the model and optimizer and starts the data afresh"
    ) from None


def newest_complete_step(checkpoint_dir: str) -> int | None:
  """The step of the newest committed checkpoint in checkpoint_dir (Orbax's test: no tmp suffix, or a commit file on
  GCS), or None; a save that did not finish is not one."""
  steps = ocp.path.step.checkpoint_steps(checkpoint_dir)
  return max(steps) if steps else None


def resume_note(config) -> str:
  """Where the same command resumes: the newest complete checkpoint (a sentence, for the lines of a stopped run)."""
  if not config.enable_checkpointing:
    return "Checkpointing is off (enable_checkpointing=false): the same command starts over."
  step = newest_complete_step(config.checkpoint_dir)
  if step is None:
    return "No checkpoint is complete: the same command starts over."
  return f"Rerun the same command to resume from the newest complete checkpoint, of step {step}."


def wait_for_saves(manager) -> None:
  """Waits for the save in flight; a full disk is a disk_full.DiskFullError naming its step."""
  step = manager.latest_step()  # Orbax lists a save from its start
  disk_full.raise_if_full(
    manager.directory, step, manager.wait_until_finished, lambda: newest_complete_step(manager.directory)
  )


def data_position(data_iterator, dataset_type: str | None = None) -> dict:
  """The data iterator's state to save, with the dataset_type (so that a resume with another one is refused)."""
  data_state = data_iterator.get_state()
  return data_state if dataset_type is None else {**data_state, "dataset_type": dataset_type}


def save_checkpoint(manager, step: int, state, data_iterator, dataset_type: str | None = None) -> float:
  """Starts saving the state after `step` (asynchronously if configured); returns the seconds the caller was blocked.

  A full disk, in this save or in the asynchronous one before it, is a disk_full.DiskFullError.

  state: what the checkpoint holds (train_state.saved of the state in its logical order).
  dataset_type: saved with the data position, so that a resume with another one is refused (restore_data_position).
  """
  start = time.time()
  wait_for_saves(manager)  # Orbax's save waits for the one in flight too; here its failure names its own step
  data_state = data_position(data_iterator, dataset_type)
  args = {STATE_ITEM: ocp.args.StandardSave(state), DATA_ITEM: DataIteratorSave(data_state)}
  save = lambda: manager.save(step, args=ocp.args.Composite(**args), force=True)
  disk_full.raise_if_full(manager.directory, step, save, lambda: newest_complete_step(manager.directory))
  fault_injection.kill_during_save(step)  # a test's SIGKILL while the save is in flight
  return time.time() - start
