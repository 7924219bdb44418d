"""Per-process numpy batches -> global jax.Arrays on the data sharding, prefetched in a background thread."""

import copy
import queue
import threading

import jax
import numpy as np

from MaxText import max_logging
from MaxText.errors import UserError
from MaxText.input_pipeline.packing import BATCH_KEYS


def process_row_range(data_sharding, global_shape) -> tuple[int, int]:
  """The [start, stop) rows of the global batch that live on this process's devices."""
  rows = [index[0] for index in data_sharding.addressable_devices_indices_map(global_shape).values()]
  start = min(r.start or 0 for r in rows)
  stop = max(global_shape[0] if r.stop is None else r.stop for r in rows)
  return start, stop


class GlobalBatchIterator:
  """Wraps a per-process iterator (rows of process_row_range) into global arrays, `prefetch` batches ahead.

  When the local data runs out it yields all-padding batches (segmentation 0: no loss, no update) so
  that processes never wait on each other; a batch with no real token anywhere means every process is
  done. get_state/set_state expose the local iterator's state as of the last batch handed out.
  """

  def __init__(self, local_iterator, data_sharding, global_shape: tuple[int, int], name: str, prefetch: int = 2):
    self._local = local_iterator
    self._sharding = data_sharding
    self._global_shape = tuple(global_shape)
    self._name = name
    self._queue = queue.Queue(maxsize=max(prefetch, 1))
    self._thread = None
    self._consumed_state = None
    self._closed = threading.Event()
    self._restored = False

  def _to_global(self, local_batch: dict) -> dict:
    return {
      k: jax.make_array_from_process_local_data(self._sharding, np.asarray(v), self._global_shape)
      for k, v in local_batch.items()
    }

  def _put(self, item) -> bool:
    while not self._closed.is_set():
      try:
        self._queue.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def _produce(self):
    produced, local_rows = 0, None
    try:
      for local_batch in self._local:
        local_rows = len(local_batch["inputs"])
        produced += 1
        # A copy: the local iterator may keep changing the same state object as it reads ahead.
        if not self._put((self._to_global(local_batch), copy.deepcopy(self._local.get_state()))):
          return
      if produced == 0 and not self._restored:
        raise UserError(f"the {self._name} data yields no tokens (empty dataset, or only empty documents?)")
      if local_rows is None:  # restored at the very end of the data
        start, stop = process_row_range(self._sharding, self._global_shape)
        local_rows = stop - start
      max_logging.log(f"Process {jax.process_index()}: the {self._name} data is used up after {produced} batches")
      state = self._local.get_state()
      padding = self._to_global({k: np.zeros((local_rows, self._global_shape[1]), np.int32) for k in BATCH_KEYS})
      while self._put((padding, state)):
        pass
    except Exception as e:  # pylint: disable=broad-except  # re-raised in the consumer's thread
      self._put((e, None))

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    if self._thread is None:
      self._thread = threading.Thread(target=self._produce, daemon=True, name=f"{self._name}-data")
      self._thread.start()
    batch, state = self._queue.get()
    if isinstance(batch, BaseException):
      self._put((batch, None))  # later calls see the same error
      raise batch
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
