"""Image-text records for the Gemma 3 tests: a whitespace word tokenizer with the image tokens, records written as JSON
lines or Parquet, and a caption set of coloured shapes drawn with PIL ("a red circle")."""

import json

import numpy as np

from MaxText.input_pipeline import images

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220)}
SHAPES = ("circle", "square", "triangle")


def word_tokenizer(path, words, image_ids: tuple[int, int, int]) -> str:
  """A whitespace word tokenizer.json whose <image_soft_token>, <start_of_image> and <end_of_image> have image_ids."""
  return _save_word_level({"<unk>": 0, **{w: i + 1 for i, w in enumerate(sorted(set(words)))}}, image_ids, path)


def id_tokenizer(path, vocab_size: int, image_ids: tuple[int, int, int]) -> str:
  """A whitespace tokenizer.json with a word per id ("t17" is 17; 0 is <unk>) and the image tokens at image_ids: the
  text a model generates spells its ids."""
  vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, vocab_size) if i not in image_ids}}
  return _save_word_level(vocab, image_ids, path)


def _save_word_level(vocab: dict, image_ids: tuple[int, int, int], path) -> str:
  from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers  # pylint: disable=import-outside-toplevel

  vocab = {**vocab, **dict(zip((images.IMAGE_TOKEN, images.BOI, images.EOI), image_ids))}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tokenizer.add_special_tokens([AddedToken(t, special=True) for t in (images.IMAGE_TOKEN, images.BOI, images.EOI)])
  tokenizer.save(str(path))
  return str(path)


def write_records(records, directory, kind: str, name: str = "data") -> str:
  """The records as JSON lines (images: paths relative to the file), or as Parquet or Arrow (a datasets Image column:
  PIL images when read); returns the file."""
  import datasets  # pylint: disable=import-outside-toplevel
  from PIL import Image  # pylint: disable=import-outside-toplevel

  if kind == "json":
    (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(directory / f"{name}.jsonl")
  opened = [dict(r, images=[Image.open(directory / image) for image in r["images"]]) for r in records]
  features = datasets.Features(
    {"prompt": datasets.Value("string"), "completion": datasets.Value("string"), "images": [datasets.Image()]}
  )
  dataset = datasets.Dataset.from_list(opened, features=features)
  if kind == "arrow":  # save_to_disk's Arrow stream file, as datasets writes one
    dataset.save_to_disk(str(directory / name))
    return str(next((directory / name).glob("*.arrow")))
  dataset.to_parquet(str(directory / f"{name}.parquet"))
  return str(directory / f"{name}.parquet")


def draw_shape(colour: str, shape: str, rng: np.random.Generator, size: int = 56):
  """A PIL image: one filled shape of a random size and place on white."""
  from PIL import Image, ImageDraw  # pylint: disable=import-outside-toplevel

  image = Image.new("RGB", (size, size), "white")
  side = int(rng.integers(size // 2, size * 3 // 4))
  x, y = rng.integers(2, size - side - 2, 2)
  box = [int(x), int(y), int(x) + side, int(y) + side]
  draw = ImageDraw.Draw(image)
  if shape == "circle":
    draw.ellipse(box, fill=COLOURS[colour])
  elif shape == "square":
    draw.rectangle(box, fill=COLOURS[colour])
  else:
    draw.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=COLOURS[colour])
  return image


def shape_records(directory, repeats: int, seed: int, prefix: str) -> list[dict]:
  """repeats x every colour and shape, as {"prompt": "what is in <|image|> ?", "completion": "a red circle", "images":
  [file]}, each image drawn anew and saved as a PNG in directory."""
  rng = np.random.default_rng(seed)
  records = []
  for k in range(repeats):
    for colour in COLOURS:
      for shape in SHAPES:
        name = f"{prefix}{k}_{colour}_{shape}.png"
        draw_shape(colour, shape, rng).save(directory / name)
        records.append({"prompt": "what is in <|image|> ?", "completion": f"a {colour} {shape}", "images": [name]})
  return records
