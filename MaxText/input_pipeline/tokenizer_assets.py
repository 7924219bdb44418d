"""Upstream MaxText's tokenizer files (its MaxText/assets/), which this project does not ship: the package from the
registry that ships one, or where to get it. Pure Python: pyconfig asks before JAX starts."""

import importlib.util
import os

# file name -> (the package and its data file that hold it, or None; where to get it otherwise)
UPSTREAM_ASSETS = {
  "tokenizer.mistral": (
    ("mistral_common", "data/tokenizer.model.v1"),
    "Mistral 7B's tokenizer.model (https://huggingface.co/mistralai/Mistral-7B-v0.1); or `pip install "
    "mistral-common`, which ships it and which MaxText then uses",
  ),
  "tokenizer": (
    None,
    "upstream's default tokenizer (its MaxText/assets/tokenizer, a 32k SentencePiece model) from an upstream checkout; "
    "or use this project's default, tokenizer_path=assets/tokenizer.default",
  ),
  "tokenizer.llama2": (None, "Llama 2's tokenizer.model (https://huggingface.co/meta-llama/Llama-2-7b-hf, gated)"),
  "tokenizer.gemma": (None, "Gemma's tokenizer.model (https://huggingface.co/google/gemma-2b, gated)"),
  "tokenizer_llama3.tiktoken": (
    None,
    "Llama 3's original/tokenizer.model, a tiktoken file (https://huggingface.co/meta-llama/Meta-Llama-3-8B, gated)",
  ),
}


def from_package(path: str) -> str | None:
  """The file that a package installed here ships for upstream's asset `path` (by its name), or None."""
  package, data_file = (_entry(path) or (None, ""))[0] or (None, "")
  spec = importlib.util.find_spec(package) if package else None  # finds the package without importing it
  if spec is None or not spec.submodule_search_locations:
    return None
  found = os.path.join(list(spec.submodule_search_locations)[0], data_file)
  return found if os.path.isfile(found) else None


def _entry(path: str):
  name = os.path.basename(path)
  if name == "tokenizer" and os.path.basename(os.path.dirname(path)) != "assets":
    return None  # "tokenizer" alone names upstream's asset only as assets/tokenizer
  return UPSTREAM_ASSETS.get(name)


def _looks_like_hub_id(path: str) -> bool:
  parts = path.split("/")
  return len(parts) == 2 and all(parts) and not path.startswith((".", "~")) and "." not in parts[1][-6:]


def where_to_get(path: str, package_dir: str) -> str:
  """For upstream's asset `path`, where to get it and where to save it; for a Hugging Face hub id, how to get it
  (MaxText never downloads); empty for another file.

  Args:
    path: tokenizer_path as given.
    package_dir: the MaxText package, where a relative `path` is looked up.
  """
  entry = _entry(path)
  if entry is None:
    if _looks_like_hub_id(path):
      return (
        f"; {path} looks like a Hugging Face hub id, and MaxText never downloads: fetch it once "
        f"(huggingface-cli download {path} --local-dir DIR) and give tokenizer_path=DIR"
      )
    return ""
  target = path if os.path.isabs(path) else os.path.join(package_dir, path)
  return f"; it is upstream MaxText's asset, which this project does not ship: save it as {target}. Get {entry[1]}"


def missing(path: str, package_dir: str) -> str:
  """The one line for a tokenizer_path that is not found."""
  return (
    f"tokenizer_path={path} does not exist (tried the cwd, {package_dir} and the config's directory)"
    f"{where_to_get(path, package_dir)}"
  )
