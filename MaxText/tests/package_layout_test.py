"""The package shows the architecture (docs/code.md, "Where things are"): entry points and four shared modules at
MaxText/'s top level, the library in folders whose imports point down, no module reaching into another's private
names, and no source file over 500 lines."""

import ast
import os
import subprocess

from MaxText.tests.helpers import REPO_ROOT

LIMIT = 500
PACKAGE = os.path.join(REPO_ROOT, "MaxText")
ENTRY_POINTS = {
  "train.py",
  "train_compile.py",
  "decode.py",
  "convert_checkpoint.py",
  "generate_param_only_checkpoint.py",
  "preprocess_data.py",
  "train_tokenizer.py",
  "plot_metrics.py",
  "list_layers.py",
  "inference_microbenchmark.py",
  # upstream's scripts that this project replaces: each says what to run instead
  "llama_or_mistral_ckpt.py",
  "convert_gemma_chkpt.py",
  "convert_gemma2_chkpt.py",
  "convert_gpt3_ckpt_from_paxml.py",
  "llama_mistral_mixtral_orbax_to_hf.py",
}
SHARED = {"__init__.py", "pyconfig.py", "errors.py", "max_logging.py", "feature_protocol.py"}
# The library's folders, each importing only those after it (and the shared top-level modules).
FOLDERS = [
  "inference",
  "aot",
  "training",
  "features",
  "generation",
  "hf_conversion",
  "checkpoints",
  "diagnostics",
  "layers",
  "input_pipeline",
  "configuration",
  "runtime",
  "launchers",
]


def _tracked_sources() -> list[str]:
  listed = subprocess.run(["git", "ls-files", "*.py", "*.sh"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
  return [path for path in listed.stdout.split() if not path.startswith("MaxText/tests/")]


def _library_modules():
  """(path relative to MaxText/, its parsed tree) for every module of the package outside the tests."""
  for root, dirs, files in os.walk(PACKAGE):
    dirs[:] = [d for d in dirs if d not in ("tests", "__pycache__", "configs", "assets")]
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(root, name)
        with open(path, encoding="utf-8") as f:
          yield os.path.relpath(path, PACKAGE), ast.parse(f.read())


def _imported(tree) -> list[tuple[int, str, list[str]]]:
  """(line, module, names) of each `from MaxText... import names` and `import MaxText...`."""
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "MaxText":
      found.append((node.lineno, node.module, [alias.name for alias in node.names]))
    elif isinstance(node, ast.Import):
      found += [(node.lineno, alias.name, []) for alias in node.names if alias.name.split(".")[0] == "MaxText"]
  return found


def test_no_source_file_outside_the_tests_passes_500_lines():
  sources = _tracked_sources()
  assert len(sources) > 100  # the listing found the tree
  long = {}
  for path in sources:
    with open(os.path.join(REPO_ROOT, path), encoding="utf-8") as f:
      lines = sum(1 for _ in f)
    if lines > LIMIT:
      long[path] = lines
  assert not long, f"over {LIMIT} lines (split by concern): {long}"


def test_the_top_level_holds_the_entry_points_and_the_shared_modules_only():
  top = {name for name in os.listdir(PACKAGE) if name.endswith(".py")}
  assert top - ENTRY_POINTS - SHARED == set(), "a library module belongs in a folder of its concern (docs/code.md)"
  folders = {n for n in os.listdir(PACKAGE) if os.path.isfile(os.path.join(PACKAGE, n, "__init__.py"))} - {"tests"}
  assert folders == set(FOLDERS), "a new folder gets its place in FOLDERS and in docs/code.md's map"


def test_folders_import_only_the_folders_below_them():
  upward = []
  for path, tree in _library_modules():
    folder = path.split(os.sep)[0]
    if folder not in FOLDERS:
      continue
    below = set(FOLDERS[FOLDERS.index(folder) :])
    for line, module, names in _imported(tree):
      targets = [module] if module != "MaxText" else [f"MaxText.{name}" for name in names]
      for target in targets:
        part = target.split(".")[1] if "." in target else ""
        if part in FOLDERS and part not in below:
          upward.append(f"MaxText/{path}:{line} imports {target}")
        if part and part not in FOLDERS and f"{part}.py" not in SHARED:
          upward.append(f"MaxText/{path}:{line} imports the entry point {target}")
  assert not upward, "\n".join(upward)


def test_no_module_imports_another_modules_private_names():
  reaching = []
  for path, tree in _library_modules():
    modules = set()
    for line, module, names in _imported(tree):
      reaching += [f"MaxText/{path}:{line} {module}.{n}" for n in names if n.startswith("_") and not n.startswith("__")]
      modules.update(names if module != "MaxText" and names else [module.split(".")[-1]])
      modules.update(names)
    for node in ast.walk(tree):
      if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
        if node.attr.startswith("_") and not node.attr.startswith("__"):
          reaching.append(f"MaxText/{path}:{node.lineno} {node.value.id}.{node.attr}")
  assert not reaching, "\n".join(reaching)
