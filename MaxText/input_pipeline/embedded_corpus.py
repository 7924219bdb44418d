"""The default dataset: real English text that ships with every CPython, so training works offline.

Documents, in a fixed order: the pydoc topic pages (`pydoc_data.topics`, the language reference behind
`help()`), then every docstring of at least 200 characters in the standard library's modules (read
with `ast`, nothing is imported). About 1.7 MB of text on Python 3.11 (PSF license). Every
EVAL_EVERY-th document is held out for eval. The text, and so the losses, depend on the Python version.
"""

import ast
import functools
import hashlib
import json
import os
import sys
import sysconfig

EVAL_EVERY = 50
_CORPUS_VERSION = 1  # bump when the extraction below changes
_MIN_DOCSTRING_CHARS = 200
# Test suites and tool packages hold few docstrings and much noise; site-packages is not the stdlib.
_SKIPPED_DIRS = {
  "test",
  "tests",
  "site-packages",
  "dist-packages",
  "idlelib",
  "lib2to3",
  "turtledemo",
  "ensurepip",
  "__pycache__",
}


def _stdlib_docstrings(stdlib_dir: str) -> list[str]:
  docs = []
  for dirpath, dirnames, filenames in os.walk(stdlib_dir):
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
    for filename in sorted(f for f in filenames if f.endswith(".py")):
      try:
        with open(os.path.join(dirpath, filename), encoding="utf-8") as f:
          tree = ast.parse(f.read())
      except (SyntaxError, UnicodeDecodeError, ValueError):
        continue
      for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
          doc = ast.get_docstring(node)
          if doc and len(doc) >= _MIN_DOCSTRING_CHARS:
            docs.append(doc)
  return docs


def _build() -> list[str]:
  from pydoc_data import topics  # pylint: disable=import-outside-toplevel

  pages = [topics.topics[name] for name in sorted(topics.topics)]
  # dict.fromkeys drops repeated texts (some docstrings are copied between modules) and keeps the order.
  return list(dict.fromkeys(pages + _stdlib_docstrings(sysconfig.get_paths()["stdlib"])))


def _cache_path() -> str:
  """Parsing the stdlib takes seconds, so the corpus is cached per Python build (and per version of this code)."""
  key = hashlib.sha256(f"{_CORPUS_VERSION} {sys.version} {sysconfig.get_paths()['stdlib']}".encode()).hexdigest()[:16]
  cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(cache_home, "maxtext", f"embedded_corpus-{key}.json")


@functools.cache
def documents() -> tuple[str, ...]:
  """All distinct documents of the corpus, in a fixed order."""
  path = _cache_path()
  try:
    with open(path, encoding="utf-8") as f:
      return tuple(json.load(f))
  except (OSError, ValueError):
    pass
  docs = _build()
  try:  # The cache is only an optimisation: an unwritable home directory is fine.
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(docs, f)
    os.replace(tmp, path)
  except OSError:
    pass
  return tuple(docs)


def split_documents(split: str) -> list[str]:
  """The "train" documents, or the held-out "eval" ones (every EVAL_EVERY-th)."""
  docs = documents()
  if split == "eval":
    return [d for i, d in enumerate(docs) if i % EVAL_EVERY == EVAL_EVERY - 1]
  return [d for i, d in enumerate(docs) if i % EVAL_EVERY != EVAL_EVERY - 1]
