"""Gemma 3 with images (transformers Gemma3ForConditionalGeneration, config Gemma3Config) <-> MaxText
decoder_block=gemma3 with use_multimodal=true.

Tensor names are those transformers writes (save_pretrained, 4 and 5 alike): the text model's are gemma3.py's under
language_model.model; the SigLIP vision tower's (vision_tower.X; the Hub's files say vision_tower.vision_model.X, and
transformers' in-memory names model.language_model.X, model.vision_tower.X, both read too) go to params/vision_encoder
(layers/vision_encoder.py), the projector's (multi_modal_projector.X) to params/vision_projector.

Only permutations: the patch embedding's conv kernel (out, C, p, p) is held as (C, p, p, out); nn.Linear weights
are transposed; the projector's weight is already (in, out).
"""

import dataclasses

from MaxText.errors import UserError
from MaxText.hf_conversion import gemma, gemma3, hf_config
from MaxText.hf_conversion.tables import Family, Param
from MaxText.layers import vision_encoder

_TEXT = "language_model.model."
_TOWER = "vision_tower."
_LAYER = _TOWER + "encoder.layers.{i}."

# transformers' SiglipVisionConfig defaults, under what the Hub's config.json gives.
VISION_DEFAULTS = {
  "hidden_size": 768,
  "intermediate_size": 3072,
  "num_hidden_layers": 12,
  "num_attention_heads": 12,
  "num_channels": 3,
  "image_size": 224,
  "patch_size": 16,
  "hidden_act": "gelu_pytorch_tanh",
  "layer_norm_eps": 1e-6,
  "vision_use_head": True,
}
# Gemma3Config's defaults.
MULTIMODAL_DEFAULTS = {"mm_tokens_per_image": 256, "image_token_index": 262_144, "boi_token_index": 255_999}


def _text(params: tuple) -> tuple:
  """gemma3.py's text params under the multimodal checkpoint's names (lm_head stays where it is)."""
  return tuple(dataclasses.replace(p, hf=p.hf.replace("model.", _TEXT, 1)) for p in params)


def _linear(maxtext: str, hf: str) -> tuple:
  return (Param(f"{maxtext}/kernel", f"{hf}.weight", "transpose"), Param(f"{maxtext}/bias", f"{hf}.bias"))


def _norm(maxtext: str, hf: str) -> tuple:
  return (Param(f"{maxtext}/scale", f"{hf}.weight"), Param(f"{maxtext}/bias", f"{hf}.bias"))


VISION_LAYER_PARAMS = (
  *_norm("layer_norm1", _LAYER + "layer_norm1"),
  *(
    p
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj")
    for p in _linear(f"self_attn/{proj}", _LAYER + f"self_attn.{proj}")
  ),
  *_norm("layer_norm2", _LAYER + "layer_norm2"),
  *_linear("fc1", _LAYER + "mlp.fc1"),
  *_linear("fc2", _LAYER + "mlp.fc2"),
)

VISION_GLOBAL_PARAMS = (
  Param("vision_encoder/patch_embedding/kernel", _TOWER + "embeddings.patch_embedding.weight", "patches"),
  Param("vision_encoder/patch_embedding/bias", _TOWER + "embeddings.patch_embedding.bias"),
  Param("vision_encoder/position_embedding", _TOWER + "embeddings.position_embedding.weight"),
  *_norm("vision_encoder/post_layernorm", _TOWER + "post_layernorm"),
  Param("vision_projector/mm_soft_emb_norm/scale", "multi_modal_projector.mm_soft_emb_norm.weight"),
  Param("vision_projector/mm_input_projection/kernel", "multi_modal_projector.mm_input_projection_weight"),
)


def tensor_names(hf: dict):
  """The Hub's and transformers' in-memory names as the ones transformers writes."""
  del hf
  renames = (
    ("vision_tower.vision_model.", _TOWER),
    ("model.vision_tower.", _TOWER),
    ("model.language_model.", _TEXT),
    ("model.multi_modal_projector.", "multi_modal_projector."),
  )

  def rename(name: str):
    for old, new in renames:
      if name.startswith(old):
        return new + name.removeprefix(old)
    return name

  return rename


def vision_config(hf: dict) -> dict:
  return {**VISION_DEFAULTS, **(hf.get("vision_config") or {})}


def config_to_maxtext(hf: dict, where: str) -> dict:
  keys = gemma3.config_to_maxtext(hf, where)
  vision, mm = vision_config(hf), {**MULTIMODAL_DEFAULTS, **hf}
  if vision["vision_use_head"]:
    raise UserError(f"{where}: vision_config.vision_use_head=true (a pooling head Gemma 3 does not have) is not supported")
  if vision["hidden_act"] != "gelu_pytorch_tanh" or vision["layer_norm_eps"] != vision_encoder.EPSILON:
    raise UserError(
      f"{where}: vision_config hidden_act={vision['hidden_act']}, layer_norm_eps={vision['layer_norm_eps']}; "
      f"Gemma 3's SigLIP has gelu_pytorch_tanh and {vision_encoder.EPSILON}"
    )
  keys.update(
    use_multimodal=True,
    image_size_for_vit=hf_config.number(vision["image_size"]),
    patch_size_for_vit=hf_config.number(vision["patch_size"]),
    num_channels_for_vit=vision["num_channels"],
    hidden_size_for_vit=vision["hidden_size"],
    intermediate_size_for_vit=vision["intermediate_size"],
    num_attention_heads_for_vit=vision["num_attention_heads"],
    num_hidden_layers_for_vit=vision["num_hidden_layers"],
    mm_tokens_per_image=mm["mm_tokens_per_image"],
    image_token_id=mm["image_token_index"],
  )
  return keys


def config_to_hf(cfg) -> dict:
  text = gemma3.config_to_hf(cfg)
  for key in ("architectures", "torch_dtype", "dtype"):
    text.pop(key, None)
  text["model_type"] = "gemma3_text"
  vision = dict(
    VISION_DEFAULTS,
    model_type="siglip_vision_model",
    vision_use_head=False,
    image_size=cfg.image_size_for_vit,
    patch_size=cfg.patch_size_for_vit,
    num_channels=cfg.num_channels_for_vit,
    hidden_size=cfg.hidden_size_for_vit,
    intermediate_size=cfg.intermediate_size_for_vit,
    num_attention_heads=cfg.num_attention_heads_for_vit,
    num_hidden_layers=cfg.num_hidden_layers_for_vit,
  )
  return dict(
    architectures=["Gemma3ForConditionalGeneration"],
    model_type="gemma3",
    text_config=text,
    vision_config=vision,
    mm_tokens_per_image=cfg.mm_tokens_per_image,
    image_token_index=cfg.image_token_id,
    tie_word_embeddings=True,
  )


FAMILY = Family(
  name="gemma3 (with images)",
  model_types=("gemma3",),
  architecture="Gemma3ForConditionalGeneration",
  decoder_block="gemma3",
  global_params=(*_text(gemma.GLOBAL_PARAMS), *VISION_GLOBAL_PARAMS),
  layer_params=_text(gemma3.LAYER_PARAMS),
  stack_params={"layers": _text(gemma3.LAYER_PARAMS), "vision_layers": VISION_LAYER_PARAMS},
  config_to_maxtext=config_to_maxtext,
  config_to_hf=config_to_hf,
  hf_tensor_name=tensor_names,
  multimodal=True,
  own_numbering=("vision_layers",),
)
