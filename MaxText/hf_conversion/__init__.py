"""Hugging Face <-> MaxText checkpoint conversion: per-family tables (`llama.py`, ...) over shared readers and writers.

Entry point: MaxText/convert_checkpoint.py.
"""

from MaxText.errors import UserError
from MaxText.hf_conversion import (
  deepseek,
  gemma,
  gemma2,
  gemma3,
  gemma3_vision,
  gpt_oss,
  llama,
  llama4,
  mistral,
  mixtral,
  qwen3,
)

FAMILIES = (
  llama.FAMILY,
  mistral.FAMILY,
  mixtral.FAMILY,
  gemma.FAMILY,
  gemma2.FAMILY,
  gemma3.FAMILY,
  gemma3_vision.FAMILY,
  qwen3.FAMILY,
  qwen3.MOE_FAMILY,
  deepseek.FAMILY,
  llama4.FAMILY,
  gpt_oss.FAMILY,
)


def family_for_hf_config(hf: dict, where: str):
  """The family of an HF config.json (its `model_type`), or a UserError naming what is supported."""
  model_type = hf.get("model_type")
  for family in FAMILIES:
    if model_type in family.model_types:
      return family
  architectures = ", ".join(hf.get("architectures") or []) or "?"
  supported = ", ".join(t for family in FAMILIES for t in family.model_types)
  raise UserError(f"{where}: unsupported architecture {architectures} (model_type '{model_type}'); supported: {supported}")


def family_for_decoder_block(decoder_block: str, multimodal: bool = False):
  """The family of a MaxText decoder_block, with images (use_multimodal) or not."""
  for family in FAMILIES:
    if family.decoder_block == decoder_block and family.multimodal == multimodal:
      return family
  supported = ", ".join(family.decoder_block for family in FAMILIES)
  raise UserError(f"decoder_block={decoder_block} has no Hugging Face conversion; supported: {supported}")
