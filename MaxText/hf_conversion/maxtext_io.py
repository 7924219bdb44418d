"""MaxText params checkpoints, one array (or one layer's slice) at a time, through TensorStore.

The writer produces the layout of an Orbax PyTree checkpoint without OCDBT (one zarr array per param, named
by its key path, and the `_METADATA` tree), which Orbax restores like its own (`load_parameters_path`).
A stacked param (scanned layers, experts) is chunked one layer/expert per chunk, so each slice is written on
its own and the whole stack is never in host memory. The reader opens Orbax checkpoints of either storage
(OCDBT, as training writes them, or one directory per array) and reads slices lazily.
"""

import json
import os
import time

import numpy as np
import tensorstore as ts

from MaxText.errors import UserError

_ZARR_DTYPES = {"float32": "<f4", "float16": "<f2", "bfloat16": "bfloat16", "float64": "<f8"}
_MAX_CHUNK_BYTES = 256 * 2**20  # big unstacked tensors (embeddings) are chunked too, so a chunk stays small
_DICT_KEY = 2  # Orbax's key_type of a dict key


def _chunks(shape: tuple, itemsize: int, single_axes: tuple) -> list[int]:
  """Chunk shape: 1 along `single_axes` (layers, experts), others halved (largest first) to <= _MAX_CHUNK_BYTES."""
  chunks = [1 if axis in single_axes else max(1, n) for axis, n in enumerate(shape)]
  while int(np.prod(chunks)) * itemsize > _MAX_CHUNK_BYTES:
    axis = int(np.argmax(chunks))
    chunks[axis] = (chunks[axis] + 1) // 2
  return chunks


def array_name(keys: tuple) -> str:
  """Orbax's name of a param: its key path joined by dots ("params.decoder.layers.mlp.wo.kernel")."""
  return ".".join(keys)


class ParamsWriter:
  """Writes {"params": ...} as an Orbax PyTree checkpoint, array by array (see the module docstring)."""

  def __init__(self, directory: str):
    if os.path.exists(directory) and os.listdir(directory):
      raise UserError(f"{directory} already exists and is not empty; choose another --output_dir (nothing is overwritten)")
    os.makedirs(directory, exist_ok=True)
    self.directory = os.path.abspath(directory)
    self._keys = []
    self._started = time.time_ns()

  def create(self, keys: tuple, shape: tuple, dtype: np.dtype, single_axes: tuple = ()) -> ts.TensorStore:
    """A new zarr array for the param at `keys`, chunked one index per chunk along `single_axes`."""
    dtype = np.dtype(dtype)
    metadata = {
      "zarr_format": 2,
      "shape": list(shape),
      "chunks": _chunks(shape, dtype.itemsize, single_axes),
      "dtype": _ZARR_DTYPES[dtype.name],
      "compressor": None,  # weights hardly compress; plain chunks write and read faster
      "fill_value": None,
      "order": "C",
      "filters": None,
      "dimension_separator": ".",
    }
    spec = {
      "driver": "zarr",
      "kvstore": {"driver": "file", "path": os.path.join(self.directory, array_name(keys))},
      "metadata": metadata,
    }
    self._keys.append(keys)
    return ts.open(spec, create=True).result()

  def finish(self) -> None:
    """Writes Orbax's metadata, which makes the directory a checkpoint (write it last)."""
    tree = {
      str(tuple(keys)): {
        "key_metadata": [{"key": k, "key_type": _DICT_KEY} for k in keys],
        "value_metadata": {"value_type": "np.ndarray", "skip_deserialize": False},
      }
      for keys in self._keys
    }
    metadata = {
      "tree_metadata": tree,
      "use_ocdbt": False,
      "use_zarr3": False,
      "store_array_data_equal_to_fill_value": True,
      "custom_metadata": None,
    }
    checkpoint_metadata = {
      "item_handlers": "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler",
      "metrics": {},
      "performance_metrics": {},
      "init_timestamp_nsecs": self._started,
      "commit_timestamp_nsecs": time.time_ns(),
      "custom_metadata": {},
    }
    for name, content in (("_METADATA", metadata), ("_CHECKPOINT_METADATA", checkpoint_metadata)):
      with open(os.path.join(self.directory, name), "w", encoding="utf-8") as f:
        json.dump(content, f)
    with open(os.path.join(self.directory, "commit_success.txt"), "w", encoding="utf-8") as f:
      f.write(f"Checkpoint successfully committed to {self.directory} at {time.ctime()}\n")


class ParamsReader:
  """Lazy access to the arrays of an Orbax PyTree checkpoint (an items directory, or params-only)."""

  def __init__(self, directory: str):
    metadata_file = os.path.join(directory, "_METADATA")
    if not os.path.isfile(metadata_file):
      raise UserError(f"{directory} is not an Orbax checkpoint (no _METADATA)")
    with open(metadata_file, encoding="utf-8") as f:
      metadata = json.load(f)
    self.directory = os.path.abspath(directory)
    self._ocdbt = bool(metadata.get("use_ocdbt"))
    self._zarr3 = bool(metadata.get("use_zarr3"))
    self.keys = [tuple(str(k["key"]) for k in v["key_metadata"]) for v in metadata["tree_metadata"].values()]

  def open(self, keys: tuple) -> ts.TensorStore:
    name = array_name(keys)
    if self._ocdbt:
      kvstore = {"driver": "ocdbt", "base": f"file://{self.directory}/", "path": name}
    else:
      kvstore = {"driver": "file", "path": os.path.join(self.directory, name)}
    return ts.open({"driver": "zarr3" if self._zarr3 else "zarr", "kvstore": kvstore}, open=True).result()

  def params(self) -> dict:
    """{key path below params: TensorStore} of every param."""
    return {keys[1:]: self.open(keys) for keys in self.keys if keys[0] == "params"}


def read(array: ts.TensorStore, index=()) -> np.ndarray:
  """A slice of an array as numpy (bfloat16 as ml_dtypes.bfloat16)."""
  return np.asarray(array[index].read().result())
