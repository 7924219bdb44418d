"""Per-process numpy batches -> global jax.Arrays on the data sharding, prefetched in a background thread."""

import queue
import threading

import jax
import numpy as np

from MaxText import sharding


def process_row_range(data_sharding, global_shape) -> tuple[int, int]:
  """The [start, stop) rows of the global batch that live on this process's devices."""
  starts, stops = set(), set()
  for index in data_sharding.addressable_devices_indices_map(global_shape).values():
    rows = index[0]
    starts.add(rows.start or 0)
    stops.add(global_shape[0] if rows.stop is None else rows.stop)
  start, stop = min(starts), max(stops)
  return start, stop


class GlobalBatchIterator:
  """Wraps a per-process iterator (rows of process_row_range) into global arrays, `prefetch` batches ahead.

  get_state/set_state expose the local iterator's state as of the last batch handed out, so that a
  checkpoint never counts prefetched batches as consumed.
  """

  def __init__(self, local_iterator, config, mesh, prefetch: int = 2):
    self._local = local_iterator
    self._sharding = sharding.data_sharding(config, mesh)
    self._global_shape = (config.global_batch_size_to_load, config.max_target_length)
    self._queue = queue.Queue(maxsize=max(prefetch, 1))
    self._thread = None
    self._consumed_state = None

  def _to_global(self, local_batch: dict) -> dict:
    return {
      k: jax.make_array_from_process_local_data(self._sharding, np.asarray(v), self._global_shape + v.shape[2:])
      for k, v in local_batch.items()
    }

  def _produce(self):
    try:
      for local_batch in self._local:
        self._queue.put((self._to_global(local_batch), self._local.get_state()))
      self._queue.put((StopIteration(), None))
    except Exception as e:  # pylint: disable=broad-except  # re-raised in the consumer's thread
      self._queue.put((e, None))

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    if self._thread is None:
      self._thread = threading.Thread(target=self._produce, daemon=True, name="data-prefetch")
      self._thread.start()
    batch, state = self._queue.get()
    if isinstance(batch, BaseException):
      self._queue.put((batch, None))  # later calls see the same end or error
      raise batch
    self._consumed_state = state
    return batch

  def get_state(self) -> dict:
    return self._local.get_state() if self._consumed_state is None else self._consumed_state

  def set_state(self, state: dict) -> None:
    if self._thread is not None:
      raise RuntimeError("set_state must be called before the first batch is read")
    self._local.set_state(state)
