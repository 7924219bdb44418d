"""Hugging Face checkpoint files, one tensor at a time: lazy reads of safetensors (or torch .bin) shards,
and a streaming safetensors writer (the header is known before any data, so tensors are written as they come).
"""

import json
import os
import struct

import numpy as np

from MaxText.errors import UserError

_SAFETENSORS_DTYPES = {
  "F32": "float32",
  "F16": "float16",
  "BF16": "bfloat16",
  "F64": "float64",
  "F8_E4M3": "float8_e4m3fn",  # DeepSeek-V3's weights, with block scales (HFCheckpoint.dequantize_fp8)
  "U8": "uint8",  # GPT-OSS's MXFP4 blocks and scales (mxfp4.py)
}
_SCALE_SUFFIX = "_scale_inv"
_MAX_SHARD_BYTES = 4 * 2**30  # shards of at most 4 GiB, as transformers' save_pretrained does (5 GB)


def _np_dtype(name: str) -> np.dtype:
  import ml_dtypes  # pylint: disable=import-outside-toplevel  # numpy has no bfloat16 or float8

  return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


class SafetensorsFile:
  """One safetensors file, read tensor by tensor with plain reads.

  Not memory-mapped (as safetensors' safe_open is): the pages of a mapped file that a conversion touches
  count in its resident memory until the file is closed, so a shard would end up resident whole.
  """

  def __init__(self, path: str):
    self.path = path
    with open(path, "rb") as f:
      try:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
      except (struct.error, ValueError) as e:
        raise UserError(f"{path} is not a safetensors file ({e})") from None
    header.pop("__metadata__", None)
    self._data_start = 8 + length
    self._header = header

  def keys(self) -> list[str]:
    return list(self._header)

  def shape(self, name: str) -> tuple:
    return tuple(self._header[name]["shape"])

  def dtype(self, name: str) -> np.dtype:
    kind = self._header[name]["dtype"]
    if kind not in _SAFETENSORS_DTYPES:
      raise UserError(f"tensor {name} in {self.path} has dtype {kind}; supported: {', '.join(_SAFETENSORS_DTYPES)}")
    return _np_dtype(_SAFETENSORS_DTYPES[kind])

  def get(self, name: str) -> np.ndarray:
    begin, end = self._header[name]["data_offsets"]
    out = np.empty(self.shape(name), self.dtype(name))
    if out.nbytes != end - begin:
      raise UserError(f"tensor {name} in {self.path}: {end - begin} bytes for shape {list(out.shape)} {out.dtype}")
    with open(self.path, "rb") as f:
      f.seek(self._data_start + begin)
      if f.readinto(memoryview(out.reshape(-1).view(np.uint8))) != out.nbytes:
        raise UserError(f"{self.path} is truncated (tensor {name})")
    return out


def _weight_files(path: str, single: str, suffix: str) -> list[str]:
  """The weight files of one format: those of its index, else the single file, else every model*<suffix>.

  (Some repositories also ship other files of the same suffix, e.g. Mistral's consolidated.safetensors.)
  """
  index = os.path.join(path, single.replace(suffix, f"{suffix}.index.json"))
  if os.path.isfile(index):
    with open(index, encoding="utf-8") as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
    for name in files:
      if not os.path.isfile(os.path.join(path, name)):
        raise UserError(f"{index} names {name}, which is missing")
    return files
  if os.path.isfile(os.path.join(path, single)):
    return [single]
  stem = single.removesuffix(suffix)
  return sorted(f for f in os.listdir(path) if f.startswith(stem) and f.endswith(suffix))


class HFCheckpoint:
  """The tensors of a local HF model directory, read lazily: safetensors (sharded or not), else torch .bin shards."""

  def __init__(self, path: str):
    self.path = path
    self.format, files = "safetensors", _weight_files(path, "model.safetensors", ".safetensors")
    if not files:
      self.format, files = "bin", _weight_files(path, "pytorch_model.bin", ".bin")
    if not files:
      raise UserError(f"{path} holds no model weights (model*.safetensors or pytorch_model*.bin)")
    self._where = {}  # tensor name -> file
    self._stored = {}  # a renamed tensor's name -> its name in the file (rename)
    self._scales = {}  # an FP8 tensor's name -> its block scales' name (dequantize_fp8)
    self._block = None
    self._handles = {}
    for name in files:
      for key in self._open(name).keys():
        self._where[key] = name

  def rename(self, new_name) -> None:
    """Shows each tensor as new_name(its name); one that new_name maps to None is hidden (e.g. the vision tower of a
    multimodal checkpoint whose text model alone is converted)."""
    where, self._where = self._where, {}
    for name, file in where.items():
      shown = new_name(name)
      if shown is not None:
        self._where[shown] = file
        self._stored[shown] = self._stored.get(name, name)

  def _open(self, name: str):
    if name not in self._handles:
      file = os.path.join(self.path, name)
      if self.format == "safetensors":
        self._handles[name] = SafetensorsFile(file)
      else:
        try:
          import torch  # pylint: disable=import-outside-toplevel
        except ImportError:
          raise UserError(f"{file} is a torch .bin shard: reading it needs torch (pip install torch)") from None
        self._handles[name] = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    return self._handles[name]

  def dequantize_fp8(self, block: tuple[int, int]) -> int:
    """Reads each tensor X that has block scales X_scale_inv (DeepSeek-V3's FP8 layout) as bfloat16
    X * scale_inv[i // block[0], j // block[1]], as DeepSeek's own fp8_cast_bf16.py does; hides the scales.
    Returns the number of such tensors."""
    for name in list(self._where):
      if name.endswith(_SCALE_SUFFIX) and name.removesuffix(_SCALE_SUFFIX) in self._where:
        self._scales[name.removesuffix(_SCALE_SUFFIX)] = name
    self._block = tuple(block)
    return len(self._scales)

  def _dequantized(self, name: str) -> np.ndarray:
    weight = self._read(name).astype(np.float32)
    scale = self._read(self._scales[name]).astype(np.float32)
    rows, cols = self._block
    expanded = np.repeat(np.repeat(scale, rows, axis=0), cols, axis=1)[: weight.shape[0], : weight.shape[1]]
    return (weight * expanded).astype(_np_dtype("bfloat16"))

  def names(self) -> list[str]:
    return [name for name in self._where if name not in self._scales.values()]

  def __contains__(self, name: str) -> bool:
    return name in self._where and name not in self._scales.values()

  def shape(self, name: str) -> tuple:
    handle, name = self._open(self._where[name]), self._stored.get(name, name)
    if self.format == "safetensors":
      return handle.shape(name)
    return tuple(handle[name].shape)

  def dtype(self, name: str) -> np.dtype:
    if name in self._scales:
      return _np_dtype("bfloat16")
    handle, name = self._open(self._where[name]), self._stored.get(name, name)
    if self.format == "safetensors":
      return handle.dtype(name)
    return _np_dtype(str(handle[name].dtype).removeprefix("torch."))

  def get(self, name: str) -> np.ndarray:
    return self._dequantized(name) if name in self._scales else self._read(name)

  def _read(self, name: str) -> np.ndarray:
    handle, name = self._open(self._where[name]), self._stored.get(name, name)
    if self.format == "safetensors":
      return handle.get(name)
    import torch  # pylint: disable=import-outside-toplevel

    tensor = handle[name]
    if tensor.dtype == torch.bfloat16:
      return tensor.view(torch.int16).numpy().view(_np_dtype("bfloat16"))
    return tensor.numpy()


def _safetensors_dtype(dtype: np.dtype) -> str:
  names = {v: k for k, v in _SAFETENSORS_DTYPES.items()}
  return names[np.dtype(dtype).name]


def plan_shards(tensors: list[tuple[str, tuple, np.dtype]], max_bytes: int = _MAX_SHARD_BYTES) -> list[list]:
  """Splits (name, shape, dtype) in order into shards of at most max_bytes (a larger tensor gets its own)."""
  shards, current, size = [], [], 0
  for name, shape, dtype in tensors:
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if current and size + nbytes > max_bytes:
      shards.append(current)
      current, size = [], 0
    current.append((name, shape, dtype))
    size += nbytes
  if current:
    shards.append(current)
  return shards


class SafetensorsWriter:
  """Writes one safetensors file whose tensors (name, shape, dtype) are declared up front, then `write`n in order."""

  def __init__(self, file: str, tensors: list[tuple[str, tuple, np.dtype]], metadata: dict | None = None):
    header, offset = {"__metadata__": metadata or {"format": "pt"}}, 0
    for name, shape, dtype in tensors:
      nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
      header[name] = {"dtype": _safetensors_dtype(dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
      offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    self._order = [(name, tuple(shape), np.dtype(dtype)) for name, shape, dtype in tensors]
    self._next = 0
    self._file = open(file, "wb")  # noqa: SIM115  # closed by close()
    self._file.write(struct.pack("<Q", len(text)) + text)

  def write(self, name: str, array: np.ndarray) -> None:
    want = self._order[self._next]
    if (name, tuple(array.shape), array.dtype) != want:
      raise ValueError(f"safetensors writer expected {want}, got ({name}, {array.shape}, {array.dtype})")
    self._file.write(np.ascontiguousarray(array).tobytes())
    self._next += 1

  def close(self) -> None:
    if self._next != len(self._order):
      raise ValueError(f"safetensors writer: {len(self._order) - self._next} tensors were not written")
    self._file.close()


def write_index(directory: str, shards: list[list], file_names: list[str]) -> None:
  """model.safetensors.index.json for a sharded checkpoint."""
  weight_map = {name: file for shard, file in zip(shards, file_names) for name, _, _ in shard}
  total = sum(int(np.prod(s)) * np.dtype(d).itemsize for shard in shards for _, s, d in shard)
  with open(os.path.join(directory, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
