"""A process's rows of each global batch, from random-access or sequential document sources.

Random access (embedded corpus, Grain ArrayRecord, TFDS ArrayRecord): row j of every global batch is the
next packed row of stream j, which holds documents j, j+R, j+2R, ... of the shuffled dataset (R = rows
of the global batch). A process builds only the streams of the rows its devices hold (processes that
hold the same rows read the same documents), the global batch does not depend on the number of processes,
and a state of a few integers per row resumes exactly. `num_workers` processes can share the rows of a process.

Sequential (TFDS TFRecord, Hugging Face streaming): one packed stream per data shard (a block of rows that
the data sharding keeps together), over that shard's share of the data, fills the shard's rows batch after
batch. Processes holding the same data shard read the same stream, so replicas always agree. A TFRecord
position saved on another number of data shards is re-split onto this run's (tfds_resplit).
"""

import multiprocessing
import queue

import numpy as np

from MaxText.errors import UserError
from MaxText.input_pipeline.packing import PackedStream, RandomAccessCursor, StreamCursor


def check_state_kind(state: dict, kind: str) -> None:
  """A UserError when a checkpoint's data position belongs to another kind of pipeline."""
  if state.get("kind") != kind:
    raise UserError(
      f"the checkpoint's data position is for a {state.get('kind', 'different')} pipeline but this run's dataset_type "
      f"reads a {kind} one: resume with the dataset_type the run was started with"
    )


def merge_process_states(own: dict, states: list[dict]) -> dict:
  """A process's data position with the per-row ("rows") or per-data-shard ("shards") positions of every
  process's state unioned in, so that a checkpoint resumes with any number of processes."""
  for key in ("rows", "shards"):
    if key in own:
      merged = {}
      for state in states:
        merged.update(state.get(key, {}))
      own = dict(own, **{key: merged})
  return own


def _stack(rows: list[dict]) -> dict:
  """Rows -> a batch: BATCH_KEYS, and what every row carries besides (a multimodal row's images)."""
  return {k: np.stack([row[k] for row in rows]) for k in rows[0]}


def _padding_like(row: dict) -> dict:
  """A padding row of a real row's keys and shapes (segmentation 0: no loss)."""
  return {k: np.zeros_like(v) for k, v in row.items()}


class RowStreamBatcher:
  """The given rows of R-row global batches, one packed stream per row."""

  def __init__(self, documents, num_rows: int, rows, seq_len: int, packing: bool = True):
    self._num_rows = num_rows
    self._rows = list(rows)
    self._streams = [PackedStream(RandomAccessCursor(documents[row::num_rows]), seq_len, packing) for row in self._rows]

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    """A row whose stream has run out is padding; raises StopIteration once every row has run out."""
    rows = []
    for stream in self._streams:
      try:
        rows.append(stream.next_row())
      except StopIteration:
        rows.append(None)
    if all(row is None for row in rows):
      raise StopIteration
    padding = _padding_like(next(r for r in rows if r is not None))
    return _stack([row if row is not None else padding for row in rows])

  def get_state(self) -> dict:
    """{"num_rows": R, "rows": {global row: stream state}}; a checkpoint unions the rows of all processes."""
    rows = {str(r): s.get_state() for r, s in zip(self._rows, self._streams)}
    return {"kind": "rows", "num_rows": self._num_rows, "rows": rows}

  def set_state(self, state: dict) -> None:
    check_state_kind(state, "rows")
    if state.get("num_rows") != self._num_rows or any(str(r) not in state.get("rows", {}) for r in self._rows):
      raise UserError(
        f"the checkpoint's data position is for a global batch of {state.get('num_rows')} rows, this run loads "
        f"{self._num_rows}: resume with the same devices x per_device_batch_size x gradient_accumulation_steps"
      )
    for row, stream in zip(self._rows, self._streams):
      stream.set_state(state["rows"][str(row)])


class ShardStreamBatcher:
  """The rows of some data shards of each batch: data shard k fills its block of rows from its own stream.

  A data shard is one of the S equal blocks of rows that the data sharding splits a global batch into;
  stream k reads the k-th of S disjoint shares of the source. Every process that holds shard k (replicas,
  e.g. tensor parallelism across hosts) therefore loads the same rows, and the global batch does not depend
  on the number of processes.
  """

  def __init__(
    self,
    open_shard_stream,
    shards,
    num_shards: int,
    rows_per_shard: int,
    num_epochs: int,
    seq_len: int,
    packing: bool = True,
    resplit=None,
  ):
    """open_shard_stream(k) -> open_stream(epoch, position) for packing.StreamCursor over share k of num_shards.

    resplit(state, num_shards, shards, num_epochs) -> {shard: stream state}: the states that resume a
    checkpoint saved on another number of data shards (tfds_resplit.resplit); None: it is refused.
    """
    self._num_shards, self._rows_per_shard, self._seq_len = num_shards, rows_per_shard, seq_len
    self._num_epochs, self._resplit = num_epochs, resplit
    self._streams = {k: PackedStream(StreamCursor(open_shard_stream(k), num_epochs), seq_len, packing) for k in shards}

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    """Rows of the shards in order; a shard whose stream ran out gives padding rows. StopIteration once all have."""
    rows = []
    for stream in self._streams.values():
      for _ in range(self._rows_per_shard):
        try:
          rows.append(stream.next_row())
        except StopIteration:
          rows.append(None)
    if all(row is None for row in rows):
      raise StopIteration
    padding = _padding_like(next(r for r in rows if r is not None))
    return _stack([row if row is not None else padding for row in rows])

  def get_state(self) -> dict:
    """{"num_shards": S, "shards": {data shard: stream state}}; a checkpoint unions the shards of all processes."""
    shards = {str(k): s.get_state() for k, s in self._streams.items()}
    return {"kind": "stream", "num_shards": self._num_shards, "shards": shards}

  def set_state(self, state: dict) -> None:
    check_state_kind(state, "stream")
    saved, saved_shards = state.get("shards"), state.get("num_shards")
    if not isinstance(saved, dict) or saved_shards is None:
      raise UserError(
        "the checkpoint's data position is for an unknown number of data shards (saved before positions were kept "
        f"per data shard), this run splits each batch into {self._num_shards}: it cannot be resumed"
      )
    if saved_shards == self._num_shards:
      missing = [k for k in self._streams if str(k) not in saved]
      if missing:
        raise UserError(
          f"the checkpoint's data position holds no position for data shard(s) {missing} of {self._num_shards}: "
          "a process's data file is missing from the checkpoint"
        )
      states = {k: saved[str(k)] for k in self._streams}
    elif self._resplit is not None:
      states = self._resplit(state, self._num_shards, list(self._streams), self._num_epochs)
    else:
      raise UserError(
        f"the checkpoint's data position is for {saved_shards} data shards, this run splits each batch into "
        f"{self._num_shards}: a Hugging Face stream (dataset_type=hf) cannot seek into other shards' records, so it "
        f"resumes only with the same data sharding: resume on a mesh whose data_sharding axes multiply to {saved_shards}"
      )
    for k, stream in self._streams.items():
      try:
        stream.set_state(states[k])
      except (KeyError, TypeError, ValueError, AttributeError):
        raise UserError(f"the checkpoint's data position of data shard {k} is malformed: {states[k]!r:.300}") from None


def _row_worker(make_batcher, state, out: multiprocessing.Queue, stop) -> None:
  """Worker process: runs a RowStreamBatcher over some rows and sends (batch, state) until told to stop."""
  try:
    batcher = make_batcher()
    if state is not None:
      batcher.set_state(state)
    for batch in batcher:
      item = (batch, batcher.get_state())
      while not stop.is_set():
        try:
          out.put(item, timeout=0.1)
          break
        except queue.Full:
          continue
      if stop.is_set():
        return
    out.put(("end", batcher.get_state()))
  except UserError as e:  # re-raised in the parent as a UserError: one line, no traceback
    out.put(("user_error", str(e)))
  except Exception as e:  # pylint: disable=broad-except  # re-raised in the parent
    out.put(("error", f"{type(e).__name__}: {e}"))


class WorkerRowStreamBatcher:
  """RowStreamBatcher whose rows are split over `num_workers` processes (tokenisation in parallel).

  make_batcher(rows) must be a picklable callable building the RowStreamBatcher of some global rows. A
  worker whose rows have all run out contributes padding rows until every worker has.
  """

  def __init__(self, make_batcher, rows, num_workers: int, prefetch: int = 2):
    rows = list(rows)
    self._all_rows = rows
    self._parts = [rows[i::num_workers] for i in range(num_workers) if rows[i::num_workers]]
    self._make, self._prefetch = make_batcher, prefetch
    self._state = {"kind": "rows", "num_rows": None, "rows": {}}
    self._workers, self._queues, self._stop = [], [], None
    self._finished = set()
    self._restore = None

  def _start(self):
    ctx = multiprocessing.get_context("spawn")  # fork is unsafe once JAX has started threads
    self._stop = ctx.Event()
    for part in self._parts:
      q = ctx.Queue(maxsize=self._prefetch)
      make = _PartBatcher(self._make, part)
      worker = ctx.Process(target=_row_worker, args=(make, self._restore, q, self._stop), daemon=True)
      worker.start()
      self._workers.append(worker)
      self._queues.append(q)

  def _receive(self, index: int):
    """The next (batch, state) of worker `index`; a dead worker is an error, not a hang."""
    while True:
      try:
        return self._queues[index].get(timeout=5)
      except queue.Empty:
        if not self._workers[index].is_alive():
          raise RuntimeError(f"data worker {index} died (exit code {self._workers[index].exitcode})") from None

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    if not self._workers:
      self._start()
    parts = {}
    for index in range(len(self._parts)):
      if index in self._finished:
        continue
      batch, state = self._receive(index)
      if batch == "user_error":
        raise UserError(state)
      if batch == "error":
        raise RuntimeError(f"data worker {index} failed: {state}")
      if batch == "end":
        self._finished.add(index)
      else:
        parts[index] = batch
      self._state["num_rows"] = state["num_rows"]
      self._state["rows"].update(state["rows"])
    if not parts:
      raise StopIteration
    rows, template = {}, next(iter(parts.values()))
    for index, part in enumerate(self._parts):
      batch = parts.get(index)
      for i, row in enumerate(part):
        rows[row] = {k: batch[k][i] if batch is not None else np.zeros_like(template[k][0]) for k in template}
    return _stack([rows[r] for r in sorted(rows)])

  def get_state(self) -> dict:
    if self._state["num_rows"] is not None:
      return self._state
    return self._restore if self._restore is not None else self._make(self._all_rows).get_state()

  def set_state(self, state: dict) -> None:
    check_state_kind(state, "rows")
    self._restore = state

  def close(self) -> None:
    if self._stop is not None:
      self._stop.set()
    for worker in self._workers:
      worker.join(timeout=5)
      if worker.is_alive():
        worker.terminate()


class _PartBatcher:
  """Picklable: builds the batcher of some rows in a worker."""

  def __init__(self, make_batcher, rows):
    self.make_batcher, self.rows = make_batcher, rows

  def __call__(self):
    return self.make_batcher(self.rows)
