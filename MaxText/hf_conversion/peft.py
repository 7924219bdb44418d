"""A LoRA run's adapters to Hugging Face: PEFT's format (adapter_config.json + adapter_model.safetensors, which
peft.PeftModel.from_pretrained loads onto the HF base), or merged into the base (a plain HF checkpoint).

The adapter of a kernel W (in... + out...) is A (in... + (r,)) and B ((r,) + out...) with W' = W + (alpha / r) A B.
PEFT's nn.Linear adapter is lora_A.weight (r, in) and lora_B.weight (out, r): A and B flattened and transposed.
The HF (out, in) layout flattens the heads of MaxText's (E, N, D) and (N, D, E) row-major (tables.to_hf), as this
does, so every op of the tables (transpose, heads_in, heads_out) takes the same rule. Tensor names are the
family's table's (model.layers.{i}.self_attn.q_proj.weight -> base_model.model.model.layers.{i}.self_attn.q_proj).
"""

import json
import os
import re
import types

import numpy as np

from MaxText.errors import UserError
from MaxText.hf_conversion import hf_io, maxtext_io
from MaxText.layers import lora

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PER_LAYER = re.compile(r"layers_(\d+)")


def adapted_modules(keys) -> list[tuple]:
  """The module paths (below params) that hold adapters, from a checkpoint's param key paths."""
  return sorted({k[:-1] for k in keys if k[-1] == "lora_a"})


def _per_layer(stores: dict, module: tuple, scan_axis: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
  """(layer, A, B) of each layer of a module, read from a scanned (decoder/layers, stacked on scan_axis) or
  per-layer (decoder/layers_<i>) checkpoint."""
  a, b = (maxtext_io.read(stores[module + (name,)]) for name in lora.ADAPTER_PARAMS)
  if module[1] == "layers":
    return [(i, np.take(a, i, scan_axis), np.take(b, i, scan_axis)) for i in range(a.shape[scan_axis])]
  return [(int(_PER_LAYER.fullmatch(module[1]).group(1)), a, b)]


def _table_param(family, module: tuple):
  if module[0] != "decoder" or not (module[1] == "layers" or _PER_LAYER.fullmatch(module[1])):
    raise UserError(f"LoRA export: {'/'.join(module)} is outside the decoder layers; only their adapters are exported")
  if family.layers_per_block != 1:
    raise UserError(f"LoRA export of {family.name} (layers stacked in blocks) is not supported yet")
  rel = "/".join(module[2:]) + "/kernel"
  param = {p.maxtext: p for p in family.layer_params}.get(rel)
  if param is None or param.experts:
    raise UserError(f"LoRA export: {rel} has no single HF nn.Linear in the {family.name} table")
  return param


def write_peft(config, family, stores: dict, output_dir: str) -> str:
  """adapter_config.json and adapter_model.safetensors of the adapters in `stores` (key path -> TensorStore)."""
  tensors, targets = {}, set()
  for module in adapted_modules(stores):
    param = _table_param(family, module)
    for layer, a, b in _per_layer(stores, module, config.param_scan_axis):
      name = param.hf.format(i=layer).removesuffix(".weight")
      rank = a.shape[-1]
      tensors[f"base_model.model.{name}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, rank).T)  # (r, in)
      tensors[f"base_model.model.{name}.lora_B.weight"] = np.ascontiguousarray(b.reshape(rank, -1).T)  # (out, r)
      targets.add(name.rsplit(".", 1)[-1])
  if not tensors:
    raise UserError("the checkpoint holds no LoRA adapters (was the run started with enable_lora=true?)")
  os.makedirs(output_dir, exist_ok=True)
  specs = [(name, value.shape, value.dtype) for name, value in tensors.items()]
  writer = hf_io.SafetensorsWriter(os.path.join(output_dir, ADAPTER_WEIGHTS), specs, metadata={"format": "pt"})
  for name, value in tensors.items():
    writer.write(name, value)
  writer.close()
  adapter_config = {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "r": int(config.lora_rank),
    "lora_alpha": float(config.lora_alpha),
    "lora_dropout": 0.0,
    "target_modules": sorted(targets),
    "bias": "none",
    "fan_in_fan_out": False,
    "use_rslora": False,
    "init_lora_weights": True,
    "base_model_name_or_path": None,
  }
  with open(os.path.join(output_dir, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
    json.dump(adapter_config, f, indent=2)
  return output_dir


class _InMemory:
  """A numpy array that converter.to_hf reads as it reads a TensorStore (array[index].read().result(), dtype)."""

  def __init__(self, value: np.ndarray):
    self.value, self.shape = value, value.shape
    self.dtype = types.SimpleNamespace(numpy_dtype=value.dtype)

  def __getitem__(self, index):
    part = self.value[index]
    return types.SimpleNamespace(read=lambda: types.SimpleNamespace(result=lambda: part))


def merged_stores(config, adapter_stores: dict, base_dir: str) -> dict:
  """The base's arrays (load_parameters_path's checkpoint) with each adapted kernel replaced by W + (alpha/r) A B."""
  base = maxtext_io.ParamsReader(base_dir).params()
  scale = float(config.lora_alpha) / int(config.lora_rank)
  merged = dict(base)
  for module in adapted_modules(adapter_stores):
    kernel_keys = module + ("kernel",)
    if kernel_keys not in base:
      raise UserError(f"{base_dir} has no {'/'.join(kernel_keys)} (a base of another layout or model?)")
    kernel = maxtext_io.read(base[kernel_keys])
    a, b = (maxtext_io.read(adapter_stores[module + (name,)]) for name in lora.ADAPTER_PARAMS)
    if module[1] == "layers":  # stacked on param_scan_axis: merge layer by layer
      axis = config.param_scan_axis
      a, b, w = (np.moveaxis(x, axis, 0) for x in (a, b, kernel))
      delta = np.einsum("lir,lro->lio", a.reshape(a.shape[0], -1, a.shape[-1]), b.reshape(b.shape[0], b.shape[1], -1))
      merged_kernel = np.moveaxis(w + scale * delta.reshape(w.shape), 0, axis)
    else:
      merged_kernel = kernel + scale * (a.reshape(-1, a.shape[-1]) @ b.reshape(b.shape[0], -1)).reshape(kernel.shape)
    merged[kernel_keys] = _InMemory(merged_kernel.astype(kernel.dtype))
  return merged
