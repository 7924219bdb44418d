"""HF directory -> MaxText directory (model.yml + params/) and back, streaming tensor by tensor."""

import json
import os
import re

import numpy as np
import yaml

from MaxText import max_logging
from MaxText.errors import UserError
from MaxText.hf_conversion import (
  family_for_decoder_block,
  family_for_hf_config,
  hf_io,
  maxtext_io,
  mxfp4,
  peft,
  plan,
  tables,
  tokenizer_files,
)

MODEL_YML = "model.yml"
PARAMS_DIR = "params"
HF_CONFIG_COPY = "hf_config.json"  # the source config.json, whose non-architecture keys to_hf keeps
_IGNORED_HF_TENSORS = ("rotary_emb.inv_freq",)  # buffers that older checkpoints saved


def read_hf_config(hf_path: str) -> dict:
  if not os.path.isdir(hf_path):
    raise UserError(f"--hf_path {hf_path} is not a directory")
  config_file = os.path.join(hf_path, "config.json")
  if not os.path.isfile(config_file):
    raise UserError(f"{config_file} is missing (a Hugging Face model directory has config.json and the weights)")
  with open(config_file, encoding="utf-8") as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise UserError(f"{config_file} is not valid JSON: {e}") from None


def maxtext_config(model_yml: str, **overrides):
  """The Config of a converted model.yml (no data or tokenizer is needed to convert)."""
  from MaxText import pyconfig  # pylint: disable=import-outside-toplevel

  overrides = {"run_name": "convert_checkpoint", "dataset_type": "synthetic", "attention": "dot_product", **overrides}
  return pyconfig.initialize(["convert_checkpoint", model_yml], environ={}, **overrides)


def abstract_param_shapes(config) -> dict:
  """{key path below params: (shape, dtype)} of the model, from jax.eval_shape (nothing allocated)."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from MaxText.layers.models import Transformer  # pylint: disable=import-outside-toplevel

  tokens = jnp.ones((1, 8), jnp.int32)
  rng = jax.random.PRNGKey(0)
  boxed = jax.eval_shape(lambda: Transformer(config).init({"params": rng, "dropout": rng}, tokens, tokens))
  flat = jax.tree_util.tree_flatten_with_path(nn.unbox(boxed)["params"])[0]
  return {tuple(str(k.key) for k in path): leaf.shape for path, leaf in flat}


_SOURCE_LINE = re.compile(r"# Converted from (.+) by MaxText/convert_checkpoint\.py\. Use it as the config file:$")


def _write_model_yml(out_dir: str, keys: dict, hf_path: str) -> str:
  path = os.path.join(out_dir, MODEL_YML)
  header = (  # its first line is _SOURCE_LINE, which to_hf reads back
    f"# Converted from {os.path.abspath(hf_path)} by MaxText/convert_checkpoint.py. Use it as the config file:\n"
    f"#   python3 MaxText/train.py {path} run_name=ft load_parameters_path={os.path.join(out_dir, PARAMS_DIR)}\n"
  )
  body = yaml.safe_dump({"base_config": "base.yml", **keys}, sort_keys=False, default_flow_style=None, width=125)
  with open(path, "w", encoding="utf-8") as f:
    f.write(header + body)
  return path


class _Progress:
  """A progress bar of bytes converted, with the count of tensors as its postfix."""

  def __init__(self, total_bytes: int, num_tensors: int, what: str):
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel

    self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=what, dynamic_ncols=True)
    self._done, self._total = 0, num_tensors

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self._bar.close()

  def update(self, nbytes: int) -> None:
    self._done += 1
    self._bar.set_postfix_str(f"{self._done}/{self._total} tensors", refresh=False)
    self._bar.update(nbytes)


def to_maxtext(hf_path: str, output_dir: str, peft_adapter: str = "") -> str:
  """Converts an HF model directory into output_dir/{model.yml, params/, tokenizer files}; returns model.yml's path.

  peft_adapter: a PEFT LoRA adapter directory of that model; its adapters join the params and model.yml turns LoRA
  on for exactly the modules it adapts (hf_conversion/peft.py).
  """
  hf_cfg = read_hf_config(hf_path)
  where = os.path.join(hf_path, "config.json")
  family = family_for_hf_config(hf_cfg, where)
  keys = family.config_to_maxtext(hf_cfg, where)
  checkpoint = hf_io.HFCheckpoint(hf_path)
  if family.hf_tensor_name is not None:
    checkpoint.rename(family.hf_tensor_name(hf_cfg))
  checkpoint = _dequantize(hf_cfg, checkpoint, where)
  if family.checkpoint_keys is not None:
    keys = family.checkpoint_keys(keys, checkpoint.names())
  if peft_adapter:
    keys.update(peft.lora_keys(family, peft_adapter, keys["base_num_decoder_layers"]))
  writer = maxtext_io.ParamsWriter(os.path.join(output_dir, PARAMS_DIR))  # refuses a non-empty one
  tokenizer = tokenizer_files.copy_to_maxtext(hf_path, output_dir)
  if tokenizer:
    keys["tokenizer_path"] = tokenizer  # found next to model.yml (pyconfig tries the config's directory)
  with open(os.path.join(output_dir, HF_CONFIG_COPY), "w", encoding="utf-8") as f:
    json.dump(hf_cfg, f, indent=2)
  model_yml = _write_model_yml(output_dir, keys, hf_path)
  config = maxtext_config(model_yml)
  arrays = plan.plan(family, abstract_param_shapes(config), config.param_scan_axis, config.logits_via_embedding, "the model")
  tensors = plan.hf_tensors(arrays)
  _check_hf_tensors(checkpoint, tensors, family, hf_path)
  stores = {}
  for array in arrays:
    dtype = checkpoint.dtype(array.slices[0].hf_name)
    stores[array.keys] = writer.create(("params", *array.keys), array.shape, dtype, array.stacked_axes)
  total = sum(plan.nbytes(array.slice_shape, checkpoint.dtype(name)) for name, _, _, array, _ in tensors)
  with _Progress(total, len(tensors), "HF -> MaxText") as bar:
    for name, _, op, array, s in tensors:
      store = stores[array.keys]
      value = tables.to_maxtext(checkpoint.get(name), op, array.slice_shape)
      store[s.index].write(np.ascontiguousarray(value, dtype=store.dtype.numpy_dtype)).result()
      bar.update(value.nbytes)
  if peft_adapter:
    shapes = abstract_param_shapes(config)
    peft.write_adapter(family, peft_adapter, shapes, config.param_scan_axis, keys["lora_rank"], writer.create)
  writer.finish()
  return model_yml


def _dequantize(hf_cfg: dict, checkpoint, where: str):
  """The checkpoint, its block-scaled FP8 weights (DeepSeek-V3's quantization_config) or MXFP4 ones (GPT-OSS's) read
  as bfloat16; other quantized checkpoints are refused in one line."""
  quantization = hf_cfg.get("quantization_config") or (hf_cfg.get("text_config") or {}).get("quantization_config")
  if not quantization:
    return checkpoint
  method, block = quantization.get("quant_method"), quantization.get("weight_block_size")
  if method == "mxfp4":
    checkpoint = mxfp4.Mxfp4Checkpoint(checkpoint)
    max_logging.log(f"Reading {checkpoint.count} MXFP4 tensors (blocks and scales) as bfloat16")
    return checkpoint
  if method != "fp8" or not block or len(block) != 2:
    raise UserError(
      f"{where}: quantization_config {method} is not supported; convert an unquantized (bfloat16) copy, FP8 with "
      "weight_block_size (DeepSeek-V3's) or mxfp4 (GPT-OSS's)"
    )
  count = checkpoint.dequantize_fp8(tuple(block))
  max_logging.log(f"Reading {count} FP8 tensors with {block[0]}x{block[1]} block scales as bfloat16")
  return checkpoint


def _check_hf_tensors(checkpoint, tensors, family, hf_path: str) -> None:
  """Every tensor the table needs exists with the shape config.json implies; no tensor is left unused."""
  for name, shape, _, array, _ in tensors:
    if name not in checkpoint:
      raise UserError(f"{hf_path} has no tensor {name} (for params/{'/'.join(array.keys)})")
    if checkpoint.shape(name) != tuple(shape):
      raise UserError(
        f"tensor {name} in {hf_path} has shape {list(checkpoint.shape(name))}; config.json implies {list(shape)}"
      )
  needed = {name for name, *_ in tensors}
  unused = sorted(n for n in checkpoint.names() if n not in needed and not n.endswith(_IGNORED_HF_TENSORS))
  if unused:
    more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
    raise UserError(
      f"{hf_path} has tensors that the {family.name} conversion does not use: {', '.join(unused[:3])}{more} "
      "(a variant of the architecture that MaxText does not support?)"
    )


class _ResolvedConfig:
  """A run's resolved config.yml (train.py writes it into the run directory) with attribute access."""

  def __init__(self, path: str):
    with open(path, encoding="utf-8") as f:
      self._values = yaml.safe_load(f)

  def __getattr__(self, key):
    try:
      return self._values[key]
    except KeyError:
      raise AttributeError(key) from None


def load_maxtext_dir(path: str):
  """(config, params directory) of a converted directory (model.yml + params/) or of a training run directory
  (config.yml + checkpoints/<step>/items, the latest step)."""
  if os.path.isfile(os.path.join(path, MODEL_YML)):
    params = os.path.join(path, PARAMS_DIR)
    if not os.path.isdir(params):
      raise UserError(f"{params} is missing (to_maxtext writes it next to model.yml)")
    return maxtext_config(os.path.join(path, MODEL_YML)), params
  checkpoints = os.path.join(path, "checkpoints")
  if os.path.isfile(os.path.join(path, "config.yml")) and os.path.isdir(checkpoints):
    steps = sorted((int(d) for d in os.listdir(checkpoints) if d.isdigit()), reverse=True)
    for step in steps:
      items = os.path.join(checkpoints, str(step), "items")
      if os.path.isfile(os.path.join(items, "_METADATA")):
        return _ResolvedConfig(os.path.join(path, "config.yml")), items
    raise UserError(f"{checkpoints} holds no checkpoint (<step>/items)")
  raise UserError(
    f"--maxtext_dir {path} has neither {MODEL_YML} + {PARAMS_DIR}/ (to_maxtext) nor config.yml + checkpoints/ (a run)"
  )


def _hf_source(config, maxtext_dir: str) -> str | None:
  """The HF directory that to_maxtext converted the base from, as its model.yml records it (that of maxtext_dir, or
  the one next to a run's load_parameters_path); None when no such record is found."""
  candidates = [os.path.join(maxtext_dir, MODEL_YML)]
  if getattr(config, "load_parameters_path", ""):
    candidates.append(os.path.join(os.path.dirname(os.path.normpath(config.load_parameters_path)), MODEL_YML))
  for path in candidates:
    if os.path.isfile(path):
      with open(path, encoding="utf-8") as f:
        match = _SOURCE_LINE.match(f.readline())
      if match:
        return match.group(1)
  return None


def _tokenizer_dir(config, maxtext_dir: str) -> str:
  """Where the tokenizer files (and hf_config.json) of a converted model are: next to its tokenizer_path."""
  path = getattr(config, "tokenizer_path", "")
  if os.path.isfile(os.path.join(maxtext_dir, HF_CONFIG_COPY)) or not path:
    return maxtext_dir
  if not os.path.isabs(path):
    path = os.path.join(maxtext_dir, path)
  return path if os.path.isdir(path) else os.path.dirname(path)


def to_hf(maxtext_dir: str, output_dir: str, merge_lora: bool = False) -> str:
  """Converts a MaxText directory into an HF directory (config.json, safetensors, tokenizer files); returns it.

  A LoRA run's checkpoint (adapters only) becomes a PEFT adapter directory, or with merge_lora the run's base
  (its load_parameters_path) with the adapters merged, as a full HF checkpoint (hf_conversion/peft.py).
  """
  config, params_dir = load_maxtext_dir(maxtext_dir)
  family = family_for_decoder_block(config.decoder_block, getattr(config, "use_multimodal", False))
  if os.path.exists(output_dir) and os.listdir(output_dir):
    raise UserError(f"{output_dir} already exists and is not empty; choose another --output_dir (nothing is overwritten)")
  reader = maxtext_io.ParamsReader(params_dir)
  stores = reader.params()
  if peft.adapted_modules(stores) and not merge_lora:
    return peft.write_peft(config, family, stores, output_dir, _hf_source(config, maxtext_dir))
  if merge_lora:
    if not peft.adapted_modules(stores) or not getattr(config, "load_parameters_path", ""):
      raise UserError(f"--merge_lora needs a LoRA run's directory started from load_parameters_path; {maxtext_dir} is not")
    stores = peft.merged_stores(config, stores, config.load_parameters_path)
  arrays = plan.plan(
    family, {k: tuple(s.shape) for k, s in stores.items()}, config.param_scan_axis, config.logits_via_embedding, params_dir
  )
  by_name = {}  # an HF tensor's name -> its pieces (op, array, slice): two where a table splits it (tables.PAIRED)
  tensors = []
  for name, shape, op, array, s in plan.hf_tensors(arrays):
    if name not in by_name:
      tensors.append((name, shape, stores[array.keys].dtype.numpy_dtype))
    by_name.setdefault(name, []).append((op, array, s))
  os.makedirs(output_dir, exist_ok=True)
  shards = hf_io.plan_shards(tensors)
  files = (
    ["model.safetensors"]
    if len(shards) == 1
    else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  )
  with _Progress(sum(plan.nbytes(s, d) for _, s, d in tensors), len(tensors), "MaxText -> HF") as bar:
    for shard, file in zip(shards, files):
      writer = hf_io.SafetensorsWriter(os.path.join(output_dir, file), shard)
      for name, _, _ in shard:
        value = tables.join_to_hf([(op, maxtext_io.read(stores[a.keys], s.index)) for op, a, s in by_name[name]])
        writer.write(name, value)
        bar.update(value.nbytes)
      writer.close()
  if len(shards) > 1:
    hf_io.write_index(output_dir, shards, files)
  source_dir = _tokenizer_dir(config, maxtext_dir)
  _write_hf_config(family, config, source_dir, output_dir, {np.dtype(d).name for _, _, d in tensors})
  tokenizer_files.copy_to_hf(source_dir, output_dir)
  return output_dir


def _write_hf_config(family, config, source_dir: str, output_dir: str, dtypes: set) -> None:
  """config.json: the family's keys from the MaxText config, over the source config.json's other keys."""
  hf_cfg = {}
  source = os.path.join(source_dir, HF_CONFIG_COPY)
  if os.path.isfile(source):
    with open(source, encoding="utf-8") as f:
      hf_cfg = json.load(f)
    hf_cfg.pop("rope_parameters", None)  # written again below, in the form both transformers 4 and 5 read
    hf_cfg.pop("quantization_config", None)  # the weights written are never quantized
  written = family.config_to_hf(config)
  if hf_cfg.get("model_type") != written["model_type"] and isinstance(hf_cfg.get("text_config"), dict):
    hf_cfg = dict(hf_cfg["text_config"])  # a multimodal source (its text model converted): the text model's keys
    hf_cfg.pop("rope_parameters", None)
  hf_cfg.update(written)
  dtype = dtypes.pop() if len(dtypes) == 1 else "float32"
  hf_cfg["torch_dtype"] = dtype
  hf_cfg.pop("dtype", None)
  with open(os.path.join(output_dir, "config.json"), "w", encoding="utf-8") as f:
    json.dump(hf_cfg, f, indent=2)
