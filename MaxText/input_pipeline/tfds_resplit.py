"""Resumes streamed TFRecord TFDS data on another number of data shards, exactly.

A checkpoint holds one stream position per data shard: shard k of S reads the k-th of S contiguous shares of
the split (tfds_source). On a mesh with S' != S data shards the shares are other ones, so the saved positions
cannot simply be used. Exact means: every record of the epochs in progress is read exactly once by the runs
before and after the checkpoint, and the tokens of a document that a saved shard's packer had begun
(PackedStream's offset) are neither lost nor packed twice.

How: this run's shards first finish the saved shards' streams, in the saved layout, then read their own
shares (the layout of S') from the next epoch on:
- S' <= S: this run's shard j finishes the saved shards j, j + S', j + 2 S', ... one after another, each
  from its saved position.
- S' > S: the rest of saved shard k's stream is dealt window by window (tfds_source._WINDOW records of a
  file, in the saved shard's order) to this run's shards k, k + S, k + 2 S, ...: the first takes the window
  in progress, the second the window after it, and so on round-robin, so that no shard pads while records
  remain.
The tokens already used of a document go with its record: whoever reads that record first drops them.
Saved shards can be in different epochs (shares differ by a record, packed documents by length): each saved
stream is finished through the latest epoch E that any of them had begun, so every epoch up to E is read
exactly once, and this run's own layout starts at epoch E + 1.

During the re-split a shard's StreamCursor is in epoch E at position {"parts": [part, ...]}: the rests of
saved streams that it reads one after another, each

    {"shard": k, "of": S, "epoch": e, "last": E, "position": {"file", "record", "offset", "taken"},
     "phase": p, "every": m, "used": t}

which reads shard k of S's stream from `position` in epoch e (the rest of its window, then every m-th window
after it), then windows p, p + m, p + 2 m, ... of each later epoch through E; the first record's first t tokens
were used before the checkpoint. A part always stands at its next record (tfds_source.settle_part), so a run
stopped during the re-split resumes exactly like any other, and its checkpoint can be re-split again: the
parts of each saved shard are dealt like a saved stream.
"""

from MaxText import max_logging
from MaxText.errors import UserError
from MaxText.input_pipeline import tfds_source


def _saved_streams(state: dict) -> tuple[int, list[tuple[int, object, int]]]:
  """(S, [(epoch, position, offset) of saved shard k]) of a checkpoint's data position; a UserError if malformed."""
  count, saved = state.get("num_shards"), state.get("shards")
  if not (tfds_source.is_count(count, 1) and isinstance(saved, dict) and set(saved) == {str(k) for k in range(count)}):
    have = sorted(saved, key=str)[:20] if isinstance(saved, dict) else saved
    raise UserError(
      f"the checkpoint's data position is for num_shards={count!r} data shards but holds positions for {have!r}: "
      "a process's data file is missing from the checkpoint, or it was edited"
    )
  streams = []
  for k in range(count):
    stream = saved[str(k)]
    cursor = stream.get("cursor") if isinstance(stream, dict) else None
    if not (
      isinstance(cursor, dict)
      and set(stream) == {"cursor", "offset"}
      and set(cursor) == {"epoch", "position"}
      and tfds_source.is_count(cursor["epoch"])
      and tfds_source.is_count(stream["offset"])
    ):
      raise UserError(f"the checkpoint's data position of data shard {k} is malformed: {stream!r:.300}")
    streams.append((cursor["epoch"], cursor["position"], stream["offset"]))
  return count, streams


def _rest_of_stream(shares, shard: int, count: int, saved: tuple, last: int) -> list[dict]:
  """The parts that finish saved shard `shard` of `count`'s stream through epoch `last`."""
  epoch, position, offset = saved
  if isinstance(position, dict) and "parts" in position:  # saved during a re-split: its parts, then its own share
    checked = tfds_source.check_parts(shares, position)
    parts = [tfds_source.settle_part(shares, {**part, "last": min(part["last"], last)}) for part in checked]
    parts.append(tfds_source.stream_part(shares, shard, count, epoch + 1, None, last))
  else:
    parts = [tfds_source.stream_part(shares, shard, count, epoch, position, last)]
  parts = [part for part in parts if part is not None]
  if offset and parts:  # the packer's current document is the first record left
    parts[0] = {**parts[0], "used": parts[0]["used"] + offset}
  return parts


def _started_epoch(epoch: int, position, offset: int) -> int:
  """The last epoch of which a saved stream had read anything (at the start of `epoch` it had read none of it)."""
  return epoch if position is not None or offset else epoch - 1


def _describe(count: int, num_shards: int, last: int) -> str:
  if last < 0:
    return "nothing of an epoch was read; this run's shards read their own shares from epoch 0"
  if num_shards == 1:
    how = "this run's one shard finishes the saved shards' streams one after another"
  elif num_shards < count:
    how = f"this run's shard j finishes the saved shards j, j+{num_shards}, ... one after another"
  else:
    how = f"the rest of saved shard k's stream is dealt window by window to this run's shards k, k+{count}, ..."
  return f"{how} to the end of epoch {last}, then each reads its own share of the split from epoch {last + 1}"


def resplit(shares, state: dict, num_shards: int, shards, num_epochs: int) -> dict[int, dict]:
  """The PackedStream states that resume a checkpoint's streams, saved on another number of data shards.

  Args:
    shares: tfds_source.Shares of the run's train split.
    state: the checkpoint's data position ({"num_shards": S, "shards": {"k": PackedStream state}}).
    num_shards: this run's number of data shards, S'.
    shards: the data shards whose states to give (this process's).
    num_epochs: the run's num_epoch (-1: forever).

  Returns:
    {shard: PackedStream state} for each of `shards`.
  """
  count, streams = _saved_streams(state)
  last = max(_started_epoch(*saved) for saved in streams)
  if num_epochs != -1:
    last = min(last, num_epochs - 1)
  how = _describe(count, num_shards, last)
  max_logging.log(f"Re-splitting the data position of {count} data shards onto {num_shards}: {how}")
  states = {}
  for shard in shards:
    if num_shards <= count:
      saved = range(shard, count, num_shards)
      parts = [part for k in saved for part in _rest_of_stream(shares, k, count, streams[k], last)]
    else:
      k, helper, helpers = shard % count, shard // count, len(range(shard % count, num_shards, count))
      rest = _rest_of_stream(shares, k, count, streams[k], last)
      parts = [piece for part in rest if (piece := tfds_source.split_part(shares, part, helpers)[helper]) is not None]
    cursor = {"epoch": last, "position": {"parts": parts}} if parts else {"epoch": last + 1, "position": None}
    states[shard] = {"cursor": cursor, "offset": 0}
  return states
