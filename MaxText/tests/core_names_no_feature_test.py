"""The core names no optional feature: it imports none of their modules (only MaxText/feature_protocol.py) and its text
names none of them. The features reach it as a list, chosen from the config in features/selection.py."""

import ast
import os
import re
import subprocess
import sys

from MaxText.tests.helpers import REPO_ROOT

PACKAGE = os.path.join(REPO_ROOT, "MaxText")
# The training core: the step, the state, the loop, where a run starts, evaluation, checkpointing, the emergency tier.
CORE = (
  "training/train_step.py",
  "training/jit_steps.py",
  "training/step_metrics.py",
  "training/train_state.py",
  "training/step_loop.py",
  "training/starting_state.py",
  "training/evaluation.py",
  "checkpoints/checkpointing.py",
  "training/emergency_checkpoint.py",
)
ALLOWED = "MaxText.feature_protocol"
# Modules that hold a feature's own code outside features/ (its layer, its diagnostics).
FEATURE_MODULES = re.compile(
  r"^MaxText\.(features\..*|layers\.(lora|qlora|quantizations|multi_token_prediction|context_parallel)"
  r"|diagnostics\.numerics_\w+|configuration\.pipeline_schedule)$"
)
FEATURE_WORDS = re.compile(
  r"dpo|grpo|reward|lora|qlora|routing_bias|fp8|numerics|mtp|pipeline_layout|distill|muon|z_loss", re.I
)


def _imports(path: str) -> set[str]:
  tree = ast.parse(open(path, encoding="utf-8").read())
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      found.add(node.module)
      found.update(f"{node.module}.{alias.name}" for alias in node.names)
  return found


def test_core_modules_import_no_feature_module_only_the_protocol():
  for name in CORE:
    imported = {m for m in _imports(os.path.join(PACKAGE, name)) if FEATURE_MODULES.match(m)}
    assert not imported, f"{name} imports feature modules {sorted(imported)}; take features as an argument ({ALLOWED})"


def test_importing_the_core_loads_no_feature_module():
  modules = ", ".join(f"MaxText.{name.removesuffix('.py').replace('/', '.')}" for name in CORE)
  code = f"import sys, {modules}; print('\\n'.join(sorted(sys.modules)))"
  loaded = subprocess.run(
    [sys.executable, "-c", code],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    check=True,
    env=os.environ | {"JAX_PLATFORMS": "cpu"},
  ).stdout.split()
  assert ALLOWED in loaded
  assert not [m for m in loaded if FEATURE_MODULES.match(m)]


def test_core_text_names_no_feature():
  for name in CORE:
    with open(os.path.join(PACKAGE, name), encoding="utf-8") as f:
      hits = [f"{name}:{i}: {line.strip()}" for i, line in enumerate(f, 1) if FEATURE_WORDS.search(line)]
    assert not hits, "\n".join(hits)
