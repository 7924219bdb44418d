"""Per-process numpy batches -> global jax.Arrays on the data sharding, prefetched in a background thread.

A process loads exactly the global rows that its devices hold, in whatever order the mesh puts them: on
real TPU meshes they are not one contiguous block (a 2-host v4-16 interleaves the hosts along fsdp, a
v5e-16 wraps around its ring), and processes that hold the same rows (tensor parallelism across hosts)
load the same rows.
"""

import copy
import queue
import threading

import jax
import jax.numpy as jnp
import numpy as np

from MaxText import max_logging
from MaxText.errors import UserError
from MaxText.input_pipeline.packing import BATCH_KEYS


def _row_range(index, num_rows: int) -> range:
  return range(*index[0].indices(num_rows))


def process_rows(data_sharding, global_shape, process_index: int | None = None) -> list[int]:
  """The global rows of a batch that the devices of a process hold, ascending (not necessarily contiguous).

  Args:
    data_sharding: the batch's sharding (its devices may belong to other processes, or to an AOT topology).
    global_shape: (rows, length) of the global batch.
    process_index: whose rows (default: this process).
  """
  process_index = jax.process_index() if process_index is None else process_index
  rows = set()
  for device, index in data_sharding.devices_indices_map(tuple(global_shape)).items():
    if device.process_index == process_index:
      rows.update(_row_range(index, global_shape[0]))
  return sorted(rows)


def data_shards(data_sharding, global_shape) -> list[range]:
  """The blocks of rows that the data sharding splits a batch into (one per data shard), in row order."""
  blocks = {_row_range(index, global_shape[0]) for index in data_sharding.devices_indices_map(tuple(global_shape)).values()}
  return sorted(blocks, key=lambda block: block.start)


def describe_rows(rows: list[int]) -> str:
  """'0-1, 4-5' for [0, 1, 4, 5]."""
  runs, start = [], None
  for i, row in enumerate(rows):
    start = row if start is None else start
    if i + 1 == len(rows) or rows[i + 1] != row + 1:
      runs.append(f"{start}-{row}" if row > start else str(start))
      start = None
  return ", ".join(runs)


def device_shard(local_batch: np.ndarray, rows: list[int], index: tuple, num_rows: int) -> np.ndarray:
  """The part of a process's local batch (its `rows`, in order) that a device with `index` into the global batch holds."""
  block = _row_range(index, num_rows)
  first = rows.index(block.start)
  if rows[first : first + len(block)] != list(block):
    raise ValueError(f"rows {block.start}..{block.stop - 1} are not all loaded by this process")
  return local_batch[(slice(first, first + len(block)), *index[1:])]


class GlobalBatchIterator:
  """Wraps a per-process iterator (its rows from process_rows, in order) into global arrays, `prefetch` ahead.

  When the local data runs out (or a process holds no document at all) it yields all-padding batches
  (segmentation 0: no loss, no update) so that processes never wait on each other; a batch with no real
  token anywhere means every process is done. A fresh iterator whose first global batch has no real
  token raises the same UserError on every process. get_state/set_state expose the local iterator's
  state as of the last batch handed out.
  """

  def __init__(
    self, local_iterator, data_sharding, global_shape: tuple[int, int], rows: list[int], name: str, prefetch: int = 2
  ):
    self._local = local_iterator
    self._sharding = data_sharding
    self._global_shape = tuple(global_shape)
    self._rows = list(rows)
    self._name = name
    self._queue = queue.Queue(maxsize=max(prefetch, 1))
    self._thread = None
    self._consumed_state = None
    self._closed = threading.Event()
    self._restored = False
    self._padding = None  # the all-padding batch handed out once the local data is used up (the same object)
    self._handed_out = 0  # batches of data handed out

  def _to_global(self, local_batch: dict) -> dict:
    def make(local):  # (rows, length), or a multimodal batch's images (rows, N, C, H, W)
      shape = (self._global_shape[0], *local.shape[1:])
      return jax.make_array_from_callback(
        shape, self._sharding, lambda index: device_shard(local, self._rows, index, self._global_shape[0])
      )

    return {k: make(np.asarray(v)) for k, v in local_batch.items()}

  def _put(self, item) -> bool:
    while not self._closed.is_set():
      try:
        self._queue.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def _produce(self):
    try:
      template = {k: np.zeros((len(self._rows), self._global_shape[1]), np.int32) for k in BATCH_KEYS}
      for local_batch in self._local:
        template = local_batch  # padding takes a real batch's keys and shapes (a multimodal one's images)
        # A copy: the local iterator may keep changing the same state object as it reads ahead.
        if not self._put((self._to_global(local_batch), copy.deepcopy(self._local.get_state()))):
          return
      state = self._local.get_state()
      padding = self._to_global({k: np.zeros_like(v) for k, v in template.items()})
      self._padding = padding  # the consumer says the data is used up when it reaches it, not this read-ahead
      while self._put((padding, state)):
        pass
    except Exception as e:  # pylint: disable=broad-except  # re-raised in the consumer's thread
      self._put((e, None))

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    first = self._thread is None
    if first:
      self._thread = threading.Thread(target=self._produce, daemon=True, name=f"{self._name}-data")
      self._thread.start()
    batch, state = self._queue.get()
    if isinstance(batch, BaseException):
      self._put((batch, None))  # later calls see the same error
      raise batch
    # Every process runs this same reduction over the global batch, so all reach the same verdict (no process
    # raises while the others wait in a collective).
    if first and not self._restored and not bool(_has_real_token(batch["targets_segmentation"])):
      raise UserError(f"the {self._name} data yields no tokens (empty dataset, or only empty documents?)")
    if batch is not self._padding:
      self._handed_out += 1
    elif self._handed_out >= 0:  # the first padding batch: the local data ended here (said once)
      max_logging.log(
        f"Process {jax.process_index()}: the {self._name} data is used up after {self._handed_out} batches",
        every_process=True,
      )
      self._handed_out = -1
    self._consumed_state = state
    return batch

  def get_state(self) -> dict:
    return self._local.get_state() if self._consumed_state is None else self._consumed_state

  def set_state(self, state: dict) -> None:
    if self._thread is not None:
      raise RuntimeError("set_state must be called before the first batch is read")
    self._local.set_state(state)
    self._restored = True

  def close(self) -> None:
    """Stops the prefetch thread; waits for it, so that no thread is inside a data library at exit."""
    self._closed.set()
    if self._thread is not None:
      self._thread.join(timeout=60)
    if hasattr(self._local, "close"):
      self._local.close()


@jax.jit
def _has_real_token(segmentation):
  return jnp.any(segmentation != 0)
