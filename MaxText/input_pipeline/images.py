"""Gemma 3's images as the model reads them, with PIL and NumPy only: each image read (a PIL image, its bytes, a
datasets Image dict or a path), made RGB, resized, rescaled and normalised as transformers' Gemma3ImageProcessorPil
does; and each image placeholder in the text expanded to the image's soft tokens as Gemma3Processor expands it.

A bad image is one UserError line naming its record: unreadable, a mode that has no RGB, or more images than the
text has placeholders (or fewer).
"""

import io
import os

import numpy as np

from MaxText.errors import UserError

BOI, IMAGE_TOKEN, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
# Gemma3ImageProcessor's: rescale by 1/255, then (x - 0.5) / 0.5 per channel (IMAGENET_STANDARD_MEAN and _STD).
RESCALE = 1 / 255
MEAN = STD = (0.5, 0.5, 0.5)
# Modes that PIL turns into RGB as transformers' convert_to_rgb does (the rest, e.g. 16-bit or float greyscale, has
# no faithful RGB).
_MODES = ("RGB", "RGBA", "L", "LA", "P", "PA", "1", "CMYK", "YCbCr", "RGBX", "RGBa", "La")


def image_sequence(soft_tokens: int) -> str:
  """The text an image becomes (Gemma3Processor's full_image_sequence): a blank line, <start_of_image>, its soft
  tokens, <end_of_image>, a blank line."""
  return f"\n\n{BOI}{IMAGE_TOKEN * soft_tokens}{EOI}\n\n"


def expand_placeholders(text: str, placeholder: str, soft_tokens: int) -> str:
  """text with every `placeholder` (image_placeholder) replaced by image_sequence(soft_tokens)."""
  return text.replace(placeholder, image_sequence(soft_tokens))


def open_image(value, where: str, base_dir: str = ""):
  """A PIL image from a PIL image, encoded bytes, a datasets Image dict ({"bytes", "path"}) or a file path (relative
  to base_dir); a UserError naming `where` when it cannot be read."""
  from PIL import Image  # pylint: disable=import-outside-toplevel

  if isinstance(value, Image.Image):
    return value
  if isinstance(value, dict):
    value = value.get("bytes") or value.get("path")
  try:
    if isinstance(value, (bytes, bytearray)):
      image = Image.open(io.BytesIO(value))
    elif isinstance(value, str) and value:
      image = Image.open(value if os.path.isabs(value) else os.path.join(base_dir, value))
    else:
      raise UserError(f"{where}: an image is {type(value).__name__}, not a PIL image, bytes or a path")
    image.load()
  except (OSError, ValueError, Image.DecompressionBombError) as e:
    raise UserError(f"{where}: an image is unreadable ({e})") from None
  return image


def to_rgb(image, where: str):
  """RGB as transformers' convert_to_rgb: transparency composited onto white; a mode without RGB refused."""
  from PIL import Image  # pylint: disable=import-outside-toplevel

  if image.mode not in _MODES:
    raise UserError(f"{where}: an image has mode {image.mode}, which has no RGB form (modes read: {', '.join(_MODES)})")
  if "A" in image.getbands() or image.info.get("transparency") is not None:
    image = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255, 255)), image).convert("RGB")
  return image.convert("RGB")


def pixel_values(image, size: int, where: str) -> np.ndarray:
  """(3, size, size) float32: the image made RGB, resized (bilinear), rescaled and normalised, as
  Gemma3ImageProcessorPil with size {height: size, width: size}."""
  from PIL import Image  # pylint: disable=import-outside-toplevel

  rgb = Image.fromarray(np.array(to_rgb(image, where)))  # through uint8 HWC, as transformers goes
  resized = np.array(rgb.resize((size, size), resample=Image.Resampling.BILINEAR, reducing_gap=None))
  x = (resized.astype(np.float64) * RESCALE).astype(np.float32)
  x = (x - np.array(MEAN, np.float32)) / np.array(STD, np.float32)
  return x.transpose(2, 0, 1)  # (C, H, W)


def check_image_token(tokenizer, config) -> None:
  """A UserError unless the tokenizer's <image_soft_token> is config.image_token_id (what the model replaces)."""
  found = tokenizer.token_id(IMAGE_TOKEN)
  if found != config.image_token_id:
    raise UserError(
      f"tokenizer_path={config.tokenizer_path} has {IMAGE_TOKEN} as id {found}, but image_token_id="
      f"{config.image_token_id}: set image_token_id to the tokenizer's"
    )


def batch_shape(config) -> tuple:
  """A batch's images: (global batch, max_num_images_per_example, channels, image size, image size)."""
  size = config.image_size_for_vit
  return (
    config.global_batch_size_to_load,
    max(config.max_num_images_per_example, 1),
    config.num_channels_for_vit,
    size,
    size,
  )


def record_pixels(images, placeholders: int, config, where: str, base_dir: str = "") -> np.ndarray:
  """A record's images' pixels (max_num_images_per_example, C, H, W), zeros after the last image.

  Args:
    images: the record's images (None or a single one: as a list of one), as open_image reads them.
    placeholders: the image placeholders in its text, one per image.
    config: the run's Config (image_placeholder, image_size_for_vit, num_channels_for_vit, max_num_images_per_example).
    where: the record, for messages.
    base_dir: where relative image paths start.
  """
  images = [] if images is None else list(images) if isinstance(images, (list, tuple, np.ndarray)) else [images]
  capacity = max(config.max_num_images_per_example, 1)
  if len(images) != placeholders:
    raise UserError(
      f"{where}: {len(images)} images but {placeholders} {config.image_placeholder} placeholders in its text (one each)"
    )
  if len(images) > capacity:
    raise UserError(f"{where}: {len(images)} images, more than max_num_images_per_example={capacity}")
  size = config.image_size_for_vit
  pixels = np.zeros((capacity, config.num_channels_for_vit, size, size), np.float32)
  for i, value in enumerate(images):
    pixels[i] = pixel_values(open_image(value, where, base_dir), size, where)
  return pixels


def record_images(text: str, images, config, where: str, base_dir: str = "") -> tuple[str, np.ndarray]:
  """A record's text with its placeholders expanded (image_sequence), and record_pixels of its images."""
  pixels = record_pixels(images, text.count(config.image_placeholder), config, where, base_dir)
  return expand_placeholders(text, config.image_placeholder, config.mm_tokens_per_image), pixels
