"""Gemma 3's image preprocessing (input_pipeline/images.py) against transformers' Gemma3Processor with
Gemma3ImageProcessorPil, on images drawn here (PNG and JPEG of several sizes, RGBA, greyscale, a palette) and a local
tokenizer with Gemma 3's image tokens: the same pixel values (within 1e-6) and the same token ids; bad images are one
line naming the record.
"""

import io

import numpy as np
import pytest
import transformers
from PIL import Image, ImageDraw

from MaxText.errors import UserError
from MaxText.input_pipeline import images
from MaxText.input_pipeline.tokenizer import build_tokenizer
from MaxText.tests.helpers import tiny_config

SIZE, SOFT_TOKENS = 56, 4
TEXT = "Compare <|image|> with<|image|>: which is brighter?"


def _drawn(mode: str, size: tuple, seed: int) -> Image.Image:
  """Noise with shapes on it, in `mode`."""
  rng = np.random.default_rng(seed)
  image = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 4), dtype=np.uint8), "RGBA")
  draw = ImageDraw.Draw(image)
  draw.ellipse((2, 3, size[0] // 2, size[1] - 4), fill=(200, 30, 60, 128))
  draw.rectangle((size[0] // 3, 1, size[0] - 2, size[1] // 2), fill=(10, 220, 90, 255))
  return image.convert(mode)


def _encoded(image: Image.Image, fmt: str) -> bytes:
  buffer = io.BytesIO()
  image.save(buffer, format=fmt)
  return buffer.getvalue()


IMAGES = {
  "png_rgb_40x30": lambda: _encoded(_drawn("RGB", (40, 30), 0), "PNG"),
  "jpeg_rgb_97x61": lambda: _encoded(_drawn("RGB", (97, 61), 1), "JPEG"),
  "png_rgba_20x33": lambda: _encoded(_drawn("RGBA", (20, 33), 2), "PNG"),
  "png_greyscale_56x56": lambda: _encoded(_drawn("L", (56, 56), 3), "PNG"),
  "jpeg_greyscale_130x70": lambda: _encoded(_drawn("L", (130, 70), 4), "JPEG"),
  "png_palette_31x17": lambda: _encoded(_drawn("P", (31, 17), 5), "PNG"),
}


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
  """(Gemma3Processor, the tokenizer.json's path): a byte-level BPE trained here, with Gemma 3's image tokens."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel

  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(), decoders.ByteLevel()
  special = ["<pad>", "<bos>", images.BOI, images.EOI, images.IMAGE_TOKEN]
  tokenizer.train_from_iterator([TEXT, "a cat\n\non a mat"] * 8, trainers.BpeTrainer(vocab_size=300, special_tokens=special))
  path = str(tmp_path_factory.mktemp("tokenizer") / "tokenizer.json")
  tokenizer.save(path)
  named = {"boi_token": images.BOI, "eoi_token": images.EOI, "image_token": images.IMAGE_TOKEN}
  fast = transformers.PreTrainedTokenizerFast(tokenizer_file=path, extra_special_tokens=named)
  image_processor = transformers.Gemma3ImageProcessorPil(size={"height": SIZE, "width": SIZE})
  return transformers.Gemma3Processor(image_processor=image_processor, tokenizer=fast, image_seq_length=SOFT_TOKENS), path


@pytest.fixture(scope="module")
def config():
  return tiny_config(
    "decoder_block=gemma3",
    "use_multimodal=true",
    f"image_size_for_vit={SIZE}",
    "patch_size_for_vit=14",
    f"mm_tokens_per_image={SOFT_TOKENS}",
    "max_num_images_per_example=3",
    "image_token_id=4000",
    "dataset_type=synthetic",
  )


@pytest.mark.parametrize("name", list(IMAGES))
def test_pixel_values_are_transformers(processor, name):
  encoded = IMAGES[name]()
  expected = processor[0].image_processor(images=Image.open(io.BytesIO(encoded)), return_tensors="np")["pixel_values"][0]
  ours = images.pixel_values(images.open_image(encoded, name), SIZE, name)
  assert ours.dtype == np.float32 and ours.shape == expected.shape
  np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-6)


def test_a_record_gives_the_processor_token_ids_and_pixels(processor, config):
  hf, tokenizer_path = processor
  pictures = [IMAGES["jpeg_rgb_97x61"](), IMAGES["png_rgba_20x33"]()]
  text, pixels = images.record_images(TEXT, pictures, config, "record 0")
  opened = [[Image.open(io.BytesIO(p)) for p in pictures]]
  expected = hf(text=[TEXT.replace(config.image_placeholder, images.BOI)], images=opened, return_tensors="np")
  ids = build_tokenizer(tokenizer_path, add_bos=False, add_eos=False).encode(text)
  assert ids == expected["input_ids"][0].tolist()
  assert pixels.shape == (3, 3, SIZE, SIZE) and not pixels[2].any()  # the third slot: padding
  np.testing.assert_allclose(pixels[:2], expected["pixel_values"], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
  "record, says",
  [
    (([b"not an image"], TEXT.replace("<|image|>", "", 1)), "record 7: an image is unreadable"),
    (([Image.new("I;16", (8, 8))], "see <|image|>"), "record 7: an image has mode I;16, which has no RGB form"),
    (([IMAGES["png_rgb_40x30"]()] * 2, "see <|image|>"), "record 7: 2 images but 1 <|image|> placeholders"),
    (([IMAGES["png_rgb_40x30"]()] * 4, "<|image|>" * 4), "record 7: 4 images, more than max_num_images_per_example=3"),
  ],
)
def test_a_bad_image_is_one_line_naming_the_record(config, record, says):
  pictures, text = record
  with pytest.raises(UserError) as error:
    images.record_images(text, pictures, config, "record 7")
  assert str(error.value).startswith(says) and "\n" not in str(error.value)
