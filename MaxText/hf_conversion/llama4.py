"""Llama 4 (transformers Llama4ForCausalLM, and the text model of Llama4ForConditionalGeneration) <-> MaxText
decoder_block=llama4.

A MaxText block holds HF layers 4b .. 4b + 3 (layer_0 .. layer_3); each layer's feed-forward is either the dense
MLP or the MoE block, so the table lists both, optional, and the model's params pick. The experts are stored fused:
gate_up_proj (E, D, 2M) is wi_0 | wi_1 on its last axis, down_proj (E, M, D) is wo as it is.
"""

import dataclasses

from MaxText import max_logging
from MaxText.configuration import common_types
from MaxText.errors import UserError
from MaxText.hf_conversion import hf_config, llama
from MaxText.hf_conversion.tables import Family, Param

LAYERS_PER_BLOCK = common_types.layers_per_block("llama4")

_FFN = "model.layers.{i}.feed_forward"
_MOE = "MoeBlock_0"

DENSE_PARAMS = (
  Param("mlp/wi_0/kernel", f"{_FFN}.gate_proj.weight", "transpose", optional=True),
  Param("mlp/wi_1/kernel", f"{_FFN}.up_proj.weight", "transpose", optional=True),
  Param("mlp/wo/kernel", f"{_FFN}.down_proj.weight", "transpose", optional=True),
)
MOE_PARAMS = (
  Param(f"{_MOE}/gate/kernel", f"{_FFN}.router.weight", "transpose", optional=True),
  Param(f"{_MOE}/wi_0", f"{_FFN}.experts.gate_up_proj", "first_half", optional=True),
  Param(f"{_MOE}/wi_1", f"{_FFN}.experts.gate_up_proj", "second_half", optional=True),
  Param(f"{_MOE}/wo", f"{_FFN}.experts.down_proj", optional=True),
  Param(f"{_MOE}/shared_experts/wi_0/kernel", f"{_FFN}.shared_expert.gate_proj.weight", "transpose", optional=True),
  Param(f"{_MOE}/shared_experts/wi_1/kernel", f"{_FFN}.shared_expert.up_proj.weight", "transpose", optional=True),
  Param(f"{_MOE}/shared_experts/wo/kernel", f"{_FFN}.shared_expert.down_proj.weight", "transpose", optional=True),
)
DECODER_LAYER_PARAMS = (
  Param("pre_self_attention_layer_norm/scale", "model.layers.{i}.input_layernorm.weight"),
  *llama.ATTENTION_PARAMS,
  Param("post_self_attention_layer_norm/scale", "model.layers.{i}.post_attention_layernorm.weight"),
  *DENSE_PARAMS,
  *MOE_PARAMS,
)
LAYER_PARAMS = tuple(
  dataclasses.replace(p, maxtext=f"layer_{j}/{p.maxtext}", layer_offset=j)
  for j in range(LAYERS_PER_BLOCK)
  for p in DECODER_LAYER_PARAMS
)


def text_config(hf: dict) -> dict:
  """The text model's config: config.json itself (Llama4ForCausalLM) or the text_config of Llama4ForConditionalGeneration."""
  return hf.get("text_config") or {} if hf.get("model_type") == "llama4" else hf


def text_tensor_name(hf: dict):
  """A multimodal checkpoint's text tensors under Llama4ForCausalLM's names (language_model.X as transformers 4
  writes them, model.language_model.X and lm_head.X as transformers 5 does); the vision tower and projector hidden."""
  if hf.get("model_type") != "llama4":
    return lambda name: name
  max_logging.log("Converting the text model of this Llama4ForConditionalGeneration; its vision tower is left out")

  def rename(name: str):
    for prefix, to in (("language_model.", ""), ("model.language_model.", "model."), ("lm_head.", "lm_head.")):
      if name.startswith(prefix):
        return to + name.removeprefix(prefix)
    return None

  return rename


def _every(interval: int, layers: int) -> list[int]:
  """Layers i with (i + 1) % interval == 0."""
  return [i for i in range(layers) if interval > 0 and (i + 1) % interval == 0]


def config_to_maxtext(hf: dict, where: str) -> dict:
  hf = text_config(hf)
  hf_config.reject_true(hf, ("attention_bias",), where)
  layers = hf_config.require(hf, "num_hidden_layers", where)
  step = hf.get("interleave_moe_layer_step", 1)
  interval = hf.get("no_rope_layer_interval", 4)
  # transformers derives no_rope_layers (where none or an empty list) and moe_layers (where null) from the intervals
  listed, moe = hf.get("no_rope_layers"), hf.get("moe_layers")
  nope = [i for i, rope in enumerate(listed) if not rope] if listed else _every(interval, layers)
  if layers % LAYERS_PER_BLOCK or step not in (1, 2, 4) or interval not in (1, 2, 4):
    raise UserError(
      f"{where}: MaxText's llama4 needs num_hidden_layers a multiple of {LAYERS_PER_BLOCK}, interleave_moe_layer_step "
      "and no_rope_layer_interval of 1, 2 or 4"
    )
  if (moe is not None and moe != _every(step, layers)) or nope not in ([], _every(interval, layers)):
    raise UserError(f"{where}: moe_layers or no_rope_layers are not every interleave_moe_layer_step / interval-th layer")
  if hf.get("num_experts_per_tok", 1) != 1:
    raise UserError(f"{where}: num_experts_per_tok={hf['num_experts_per_tok']} is not supported for llama4 (1 only)")
  theta, scaling = hf_config.rope(hf, where)
  keys = hf_config.common_keys(hf, where, "llama4", theta)
  if scaling:
    keys.update(hf_config.llama3_rope_keys(scaling, where))
  keys.update(
    base_mlp_dim=hf_config.require(hf, "intermediate_size_mlp", where),
    base_moe_mlp_dim=hf_config.require(hf, "intermediate_size", where),
    num_experts=hf_config.require(hf, "num_local_experts", where),
    num_experts_per_tok=1,
    shared_experts=1,
    interleave_moe_layer_step=step,
    nope_layer_interval=interval if nope else -1,
    chunk_attn_window_size=hf.get("attention_chunk_size") or 0,
    use_qk_norm=bool(hf.get("use_qk_norm", True)),
    temperature_tuning=bool(hf.get("attn_temperature_tuning", True)),
    temperature_tuning_scale=float(hf.get("attn_scale", 0.1)),
    temperature_tuning_floor_scale=hf_config.number(hf.get("floor_scale", 8192)),
  )
  return keys


def config_to_hf(cfg) -> dict:
  keys = hf_config.decoder_config(cfg, "llama4_text", "Llama4ForCausalLM")
  keys.pop("mlp_bias")
  layers, interval = cfg.num_decoder_layers, cfg.nope_layer_interval
  nope = _every(interval, layers)
  keys.update(
    intermediate_size=cfg.moe_mlp_dim,
    intermediate_size_mlp=cfg.mlp_dim,
    num_local_experts=cfg.num_experts,
    num_experts_per_tok=1,
    interleave_moe_layer_step=cfg.interleave_moe_layer_step,
    moe_layers=_every(cfg.interleave_moe_layer_step, layers),
    no_rope_layer_interval=interval if interval > 0 else 4,
    no_rope_layers=[int(i not in nope) for i in range(layers)],
    attention_chunk_size=cfg.chunk_attn_window_size or None,
    layer_types=[
      "chunked_attention" if i not in nope and cfg.chunk_attn_window_size else "full_attention" for i in range(layers)
    ],
    use_qk_norm=bool(cfg.use_qk_norm),
    attn_temperature_tuning=bool(cfg.temperature_tuning),
    attn_scale=cfg.temperature_tuning_scale,
    floor_scale=hf_config.number(cfg.temperature_tuning_floor_scale),
    rope_scaling=hf_config.llama3_rope_config(cfg),
  )
  return keys


FAMILY = Family(
  name="llama4",
  model_types=("llama4_text", "llama4"),  # llama4: the text model of Llama4ForConditionalGeneration
  architecture="Llama4ForCausalLM",
  decoder_block="llama4",
  global_params=llama.GLOBAL_PARAMS,
  layer_params=LAYER_PARAMS,
  config_to_maxtext=config_to_maxtext,
  config_to_hf=config_to_hf,
  hf_tensor_name=text_tensor_name,
)
