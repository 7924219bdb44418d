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
  "tokenizer.llama2": (None, "Llama 2's tokenizer.model (https://huggingface.co/meta-llama/Llama-2-7b-hf, gated)"),
  "tokenizer.gemma": (None, "Gemma's tokenizer.model (https://huggingface.co/google/gemma-2b, gated)"),
  "tokenizer_llama3.tiktoken": (
    None,
    "Llama 3's original/tokenizer.model, a tiktoken file (https://huggingface.co/meta-llama/Meta-Llama-3-8B, gated)",
  ),
}


def from_package(path: str) -> str | None:
  """The file that a package installed here ships for upstream's asset `path` (by its name), or None."""
  package, data_file = UPSTREAM_ASSETS.get(os.path.basename(path), (None, ""))[0] or (None, "")
  spec = importlib.util.find_spec(package) if package else None  # finds the package without importing it
  if spec is None or not spec.submodule_search_locations:
    return None
  found = os.path.join(list(spec.submodule_search_locations)[0], data_file)
  return found if os.path.isfile(found) else None


def where_to_get(path: str, package_dir: str) -> str:
  """For upstream's asset `path`: where to get it and where to save it (empty for another file).

  Args:
    path: tokenizer_path as given.
    package_dir: the MaxText package, where a relative `path` is looked up.
  """
  entry = UPSTREAM_ASSETS.get(os.path.basename(path))
  if entry is None:
    return ""
  target = path if os.path.isabs(path) else os.path.join(package_dir, path)
  return f"; it is upstream MaxText's asset, which this project does not ship: save it as {target}. Get {entry[1]}"
