"""MXFP4 weights (GPT-OSS's released checkpoints: quantization_config quant_method mxfp4) read as bfloat16.

A quantized tensor X is stored as X_blocks (..., N, G, 16) uint8, two 4-bit E2M1 codes a byte (low nibble first), and
X_scales (..., N, G) uint8, a power-of-two exponent (E8M0, bias 127) for each block of 32 values. Dequantized as
transformers' convert_moe_packed_tensors: value = FP4[code] * 2^(scale - 127), laid out (..., G * 32, N), the
layout of the unquantized checkpoint's tensor X.
"""

import ml_dtypes
import numpy as np

BLOCKS, SCALES = "_blocks", "_scales"
# The 16 E2M1 values of a 4-bit code (sign bit 3), as transformers' FP4_VALUES.
FP4_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """(..., N, G, 16) uint8 codes and (..., N, G) uint8 exponents -> (..., G * 32, N) bfloat16.

  Args:
    blocks: two codes a byte, the low nibble the first of the pair.
    scales: each block's exponent + 127.
  """
  if blocks.shape[:-1] != scales.shape:
    raise ValueError(f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape}")
  codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 2 * blocks.shape[-1])
  exponents = scales.astype(np.int32)[..., None] - 127
  values = np.ldexp(FP4_VALUES[codes], exponents).astype(ml_dtypes.bfloat16)  # (..., N, G, 32)
  values = values.reshape(*values.shape[:-2], -1)  # (..., N, G * 32)
  return np.swapaxes(values, -1, -2)


class Mxfp4Checkpoint:
  """An HFCheckpoint whose MXFP4 pairs (X_blocks, X_scales) show as one bfloat16 tensor X each (and themselves not)."""

  def __init__(self, checkpoint):
    self._checkpoint = checkpoint
    names = set(checkpoint.names())
    self._packed = {
      n.removesuffix(BLOCKS): n.removesuffix(BLOCKS) + SCALES
      for n in names
      if n.endswith(BLOCKS) and n.removesuffix(BLOCKS) + SCALES in names
    }

  @property
  def count(self) -> int:
    return len(self._packed)

  def names(self) -> list[str]:
    hidden = {name + suffix for name in self._packed for suffix in (BLOCKS, SCALES)}
    return [n for n in self._checkpoint.names() if n not in hidden] + sorted(self._packed)

  def __contains__(self, name: str) -> bool:
    return name in self._packed or (name in self._checkpoint and not name.endswith((BLOCKS, SCALES)))

  def shape(self, name: str) -> tuple:
    if name not in self._packed:
      return self._checkpoint.shape(name)
    *prefix, rows, groups, pairs = self._checkpoint.shape(name + BLOCKS)
    return (*prefix, groups * pairs * 2, rows)

  def dtype(self, name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name in self._packed else self._checkpoint.dtype(name)

  def get(self, name: str) -> np.ndarray:
    if name not in self._packed:
      return self._checkpoint.get(name)
    return dequantize(self._checkpoint.get(name + BLOCKS), self._checkpoint.get(self._packed[name]))
