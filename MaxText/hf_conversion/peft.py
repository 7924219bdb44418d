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

from MaxText import max_logging
from MaxText.configuration import common_types
from MaxText.errors import UserError
from MaxText.hf_conversion import hf_io, maxtext_io, plan
from MaxText.layers import lora

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapted_modules(keys) -> list[tuple]:
  """The module paths (below params) that hold adapters, from a checkpoint's param key paths."""
  return sorted({k[:-1] for k in keys if k[-1] == "lora_a"})


# Dense nn.Linear projections whose adapter PEFT (0.21, on transformers 5) reads by their name (gate_proj, up_proj,
# down_proj) as one of the MoE experts' (its v4 -> v5 conversion of deepseek_v3 and the other qwen2_moe-like models).
_READ_AS_EXPERTS = {"deepseek": ("mlp/wi_0", "mlp/wi_1", "mlp/wo")}


def _layer_offsets(config, family) -> dict[str, int]:
  """The first HF layer of each stack (DeepSeek's moe_layers follow its dense_layers)."""
  stacks = common_types.layer_stacks(
    config.decoder_block, config.num_decoder_layers, getattr(config, "first_num_dense_layers", 0)
  )
  offsets, first = {}, 0
  for stack, blocks in stacks.items():
    offsets[stack], first = first, first + blocks * family.layers_per_block
  return offsets


def _table_param(family, module: tuple, scan_axis: int):
  """(table Param, stack, block or None when scanned) of an adapted module, or a UserError naming it where it has
  no PEFT nn.Linear."""
  rule, stack, block, _ = plan.rule_for(module + ("kernel",), family, scan_axis)
  where = "/".join(module)
  if stack is None or stack == "mtp":
    raise UserError(
      f"LoRA export: {where} is outside the HF model's decoder layers, so PEFT's adapter cannot hold it; export with "
      "--merge_lora, or train with a lora_module_path that leaves it out"
    )
  rel = "/".join(module[2:])
  if rule is None or rule.experts or rule.op == "identity" or rel.startswith("MoeBlock_0/gate"):
    raise UserError(f"LoRA export: {where} has no single HF nn.Linear in the {family.name} table (PEFT cannot hold it)")
  if rel in _READ_AS_EXPERTS.get(family.name, ()):
    hf = rule.hf.format(i="{i}").removesuffix(".weight")
    raise UserError(
      f"LoRA export: {where} is {hf}, which PEFT on transformers 5 loads as the MoE experts' fused weights of "
      f"{family.name}, not as this nn.Linear; export with --merge_lora, or train with a lora_module_path that leaves "
      "it out"
    )
  return rule, stack, block


def hf_adapters(config, family, stores: dict) -> list[tuple[str, np.ndarray, np.ndarray]]:
  """(HF module name, A, B) of every adapted layer: A (in... + (r,)) and B ((r,) + out...) of one HF layer."""
  offsets, out = _layer_offsets(config, family), []
  for module in adapted_modules(stores):
    param, stack, block = _table_param(family, module, config.param_scan_axis)
    a, b = (maxtext_io.read(stores[module + (name,)]) for name in lora.ADAPTER_PARAMS)
    if block is None:  # scanned: the stack's blocks on param_scan_axis
      axis = config.param_scan_axis
      per_block = [(i, np.take(a, i, axis), np.take(b, i, axis)) for i in range(a.shape[axis])]
    else:
      per_block = [(block, a, b)]
    for i, a_i, b_i in per_block:
      layer = offsets[stack] + i * family.layers_per_block + param.layer_offset
      out.append((param.hf.format(i=layer).removesuffix(".weight"), a_i, b_i))
  return out


def _target_modules(names: list[str], num_layers: int):
  """PEFT's target_modules: the projections' names below a layer (self_attn.q_proj) where every layer has the
  adapter; otherwise (some layers only, e.g. Gemma 2's local ones) a regex of exactly the adapted modules."""
  by_target = {}
  for name in names:
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if match is None:
      return sorted(names)
    by_target.setdefault(match.group(2), set()).add(int(match.group(1)))
  if all(layers == set(range(num_layers)) for layers in by_target.values()):
    return sorted(by_target)
  groups = {}  # the HF layers -> the projections adapted in exactly those layers
  for target, layers in by_target.items():
    groups.setdefault(tuple(sorted(layers)), []).append(re.escape(target))
  return "|".join(
    rf"model\.layers\.(?:{'|'.join(map(str, layers))})\.(?:{'|'.join(sorted(targets))})"
    for layers, targets in sorted(groups.items())
  )


def write_peft(config, family, stores: dict, output_dir: str, base_model: str | None = None) -> str:
  """adapter_config.json and adapter_model.safetensors of the adapters in `stores` (key path -> TensorStore);
  base_model: the HF base's directory, when known (base_model_name_or_path)."""
  tensors, names = {}, []
  for name, a, b in hf_adapters(config, family, stores):
    rank = a.shape[-1]
    tensors[f"base_model.model.{name}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, rank).T)  # (r, in)
    tensors[f"base_model.model.{name}.lora_B.weight"] = np.ascontiguousarray(b.reshape(rank, -1).T)  # (out, r)
    names.append(name)
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
    "target_modules": _target_modules(names, int(config.num_decoder_layers)),
    "bias": "none",
    "fan_in_fan_out": False,
    "use_rslora": False,
    "init_lora_weights": True,
    "base_model_name_or_path": base_model,
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
    if module[1] in common_types.STACK_NAMES:  # stacked on param_scan_axis: merge layer by layer
      axis = config.param_scan_axis
      a, b, w = (np.moveaxis(x, axis, 0) for x in (a, b, kernel))
      delta = np.einsum("lir,lro->lio", a.reshape(a.shape[0], -1, a.shape[-1]), b.reshape(b.shape[0], b.shape[1], -1))
      merged_kernel = np.moveaxis(w + scale * delta.reshape(w.shape), 0, axis)
    else:
      merged_kernel = kernel + scale * (a.reshape(-1, a.shape[-1]) @ b.reshape(b.shape[0], -1)).reshape(kernel.shape)
    merged[kernel_keys] = _InMemory(merged_kernel.astype(kernel.dtype))
  return merged


def _in_dims(op: str) -> int:
  return 2 if op == "heads_out" else 1  # heads_out's kernel is (N, D, E); the others' input is one dim


_MERGE = "merge it into its base with PEFT's merge_and_unload(), save that and convert it without --peft_adapter"
# adapter_config.json fields of PEFT features beyond out = x W + (alpha / r) x A B on the decoder layers' projections:
# set (not None, False or empty), the adapter would convert without them, so it is refused.
_UNSUPPORTED_FIELDS = (
  "trainable_token_indices",
  "lora_bias",
  "layer_replication",
  "target_parameters",
  "alora_invocation_tokens",
  "use_qalora",
  "use_bdlora",
  "kasa_config",
  "monteclora_config",
  "arrow_config",
)


def _cannot(adapter_dir: str, what: str) -> UserError:
  return UserError(f"--peft_adapter {adapter_dir} {what}, which MaxText's LoRA cannot represent; {_MERGE}")


def read_adapter_config(adapter_dir: str) -> dict:
  path = os.path.join(adapter_dir, ADAPTER_CONFIG)
  if not os.path.isfile(path):
    raise UserError(f"--peft_adapter {adapter_dir} has no {ADAPTER_CONFIG} (a PEFT adapter directory)")
  with open(path, encoding="utf-8") as f:
    adapter_config = json.load(f)
  if adapter_config.get("peft_type") != "LORA" or adapter_config.get("use_rslora") or adapter_config.get("use_dora"):
    raise UserError(f"{path}: only plain LoRA adapters are read (peft_type LORA, without rslora or DoRA)")
  if adapter_config.get("modules_to_save"):
    raise _cannot(adapter_dir, f"holds trained copies of modules_to_save {adapter_config['modules_to_save']}")
  if adapter_config.get("bias", "none") != "none":
    raise _cannot(adapter_dir, f"holds trained biases (bias {adapter_config['bias']!r})")
  for field in _UNSUPPORTED_FIELDS:
    if adapter_config.get(field):
      raise _cannot(adapter_dir, f"holds {field} {adapter_config[field]}")
  # One rank and alpha for every module: a pattern that sets another one is a model we cannot hold.
  for field, default in (("alpha_pattern", adapter_config.get("lora_alpha")), ("rank_pattern", adapter_config.get("r"))):
    pattern = adapter_config.get(field) or {}
    if any(value != default for value in pattern.values()):
      raise _cannot(adapter_dir, f"holds {field} {pattern} (per-module alpha or rank)")
  if adapter_config.get("lora_dropout"):  # acts in training only: the adapter's model is the same without it
    max_logging.warn(f"lora_dropout {adapter_config['lora_dropout']} is not applied (MaxText's LoRA has no dropout)")
  return adapter_config


def _check_all_read(adapter_dir: str, names: set, read: set) -> None:
  """Every tensor of the adapter is read: one the conversion does not know would otherwise be dropped silently."""
  unread = sorted(names - read)
  for name in unread:  # a module's adapter that MaxText has no place for (embeddings, lm_head, experts...)
    match = re.fullmatch(r"base_model\.model\.(.+)\.(lora_embedding_A|lora_embedding_B|lora_A\.weight|lora_B\.weight)", name)
    if match:
      kind = "lora_embedding_A/B" if "embedding" in match.group(2) else "lora_A/B"
      raise _cannot(adapter_dir, f"adapts {match.group(1)} ({kind})")
  if unread:
    more = f" and {len(unread) - 3} more" if len(unread) > 3 else ""
    raise UserError(
      f"--peft_adapter {adapter_dir} holds {', '.join(unread[:3])}{more}, which the conversion does not read; {_MERGE}"
    )


def lora_keys(family, adapter_dir: str, num_layers: int) -> dict:
  """The config keys of the adapter: enable_lora, lora_rank, lora_alpha, and lora_module_path naming exactly the
  modules it adapts (every layer's; an adapter of some layers only is refused). Every tensor of the adapter must be
  one that write_adapter reads (anything else is refused, not dropped)."""
  adapter_config = read_adapter_config(adapter_dir)
  if family.layers_per_block != 1:
    raise UserError(f"--peft_adapter for {family.name} (layers stacked in blocks) is not supported yet")
  names = set(hf_io.SafetensorsFile(os.path.join(adapter_dir, ADAPTER_WEIGHTS)).keys())
  modules, read = [], set()
  for param in family.layer_params:
    if param.experts or not param.maxtext.endswith("/kernel"):
      continue
    prefixes = [f"base_model.model.{param.hf.format(i=i).removesuffix('.weight')}" for i in range(num_layers)]
    present = [f"{prefix}.lora_A.weight" in names for prefix in prefixes]
    if any(present) and not all(present):
      raise UserError(f"--peft_adapter {adapter_dir} adapts {param.hf} in some layers only; MaxText adapts all or none")
    if all(present):
      modules.append(param.maxtext.removesuffix("/kernel"))
      read.update(f"{prefix}.lora_{ab}.weight" for prefix in prefixes for ab in "AB")
  _check_all_read(adapter_dir, names, read)
  if not modules:
    raise UserError(f"--peft_adapter {adapter_dir} adapts none of the {family.name} layers' projections")
  rank = int(adapter_config["r"])
  return {
    "enable_lora": True,
    "lora_rank": rank,
    "lora_alpha": float(adapter_config.get("lora_alpha", rank)),
    "lora_module_path": f"^decoder/layers/({'|'.join(modules)})$",
  }


def write_adapter(family, adapter_dir: str, shapes: dict, scan_axis: int, rank: int, create) -> None:
  """Writes the PEFT adapter's A and B as MaxText's lora_a and lora_b, stacked on scan_axis like the kernels of
  `shapes` (key path -> shape of the model's scanned params), through create(keys, shape, dtype) -> TensorStore."""
  weights = hf_io.SafetensorsFile(os.path.join(adapter_dir, ADAPTER_WEIGHTS))
  names = set(weights.keys())
  for param in family.layer_params:
    kernel_keys = ("decoder", "layers", *param.maxtext.split("/"))
    first = f"base_model.model.{param.hf.format(i=0).removesuffix('.weight')}.lora_A.weight"
    if param.experts or kernel_keys not in shapes or first not in names:
      continue
    module = kernel_keys[:-1]
    kernel_shape = list(shapes[kernel_keys])
    layers = kernel_shape.pop(scan_axis)
    n_in = _in_dims(param.op)
    a_layers, b_layers = [], []
    for i in range(layers):
      name = f"base_model.model.{param.hf.format(i=i).removesuffix('.weight')}"
      a, b = weights.get(f"{name}.lora_A.weight"), weights.get(f"{name}.lora_B.weight")
      fan_in, fan_out = int(np.prod(kernel_shape[:n_in])), int(np.prod(kernel_shape[n_in:]))
      if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
        raise UserError(
          f"--peft_adapter {adapter_dir}: {name} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; this base "
          f"needs {[rank, fan_in]} and {[fan_out, rank]} (an adapter of another base model?)"
        )
      a_layers.append(a.T.reshape(*kernel_shape[:n_in], rank))
      b_layers.append(b.T.reshape(rank, *kernel_shape[n_in:]))
    for keys, stacked in ((module + ("lora_a",), a_layers), (module + ("lora_b",), b_layers)):
      value = np.stack(stacked, axis=scan_axis).astype(np.float32)
      create(("params", *keys), value.shape, value.dtype).write(value).result()
