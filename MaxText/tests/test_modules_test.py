"""No module of MaxText/tests imports a test module (*_test.py): what several tests share lives in helpers.py or
tiny_models.py. Read with ast, nothing imported; code passed to `python -c` as a string is not looked at."""

import ast
import pathlib

TESTS_DIR = pathlib.Path(__file__).resolve().parent
PACKAGE = "MaxText.tests"


def _test_module_in(dotted: str) -> str | None:
  """The *_test module of MaxText.tests that a dotted module name is or is inside, if any."""
  if not dotted.startswith(PACKAGE + "."):
    return None
  name = dotted[len(PACKAGE) + 1 :].split(".", maxsplit=1)[0]
  return name if name.endswith("_test") else None


def imported_test_modules(source: str) -> list[tuple[int, str]]:
  """(line, imported test module) of every import in `source` that names a *_test module of MaxText.tests: `import
  MaxText.tests.x_test`, `from MaxText.tests.x_test import ...`, `from MaxText.tests import x_test` and their relative
  forms (`from .x_test import ...`, `from . import x_test`), at any depth (inside functions too)."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      found += [(node.lineno, m) for m in map(_test_module_in, (a.name for a in node.names)) if m]
    elif isinstance(node, ast.ImportFrom) and node.level <= 1:
      module = ".".join(p for p in (PACKAGE if node.level == 1 else "", node.module or "") if p)
      if module == PACKAGE:  # from MaxText.tests import x_test
        found += [(node.lineno, m) for m in map(_test_module_in, (f"{PACKAGE}.{a.name}" for a in node.names)) if m]
      elif _test_module_in(module):
        found.append((node.lineno, _test_module_in(module)))
  return sorted(found)


def test_the_check_sees_every_form_of_import():
  source = "\n".join(
    [
      "from MaxText.tests.sft_test import CHATML",
      "from MaxText.tests import decode_test, helpers",
      "import MaxText.tests.kill_resume_test",
      "import MaxText.tests.kill_resume_test as krt",
      "def f():",
      "  from MaxText.tests.lora_test import lora_run",
      "from .dpo_test import PAIRS",
      "from . import families_test",
      "from MaxText.tests.helpers import tiny_config",  # not a test module: fine
      "from MaxText.tests import helpers, tiny_models",
      "import MaxText.tests.sharded_runs",
      "from MaxText.tests.fixtures import make_fixtures",
      "code = 'from MaxText.tests.qlora_test import x'",  # a string: out of scope
    ]
  )
  assert imported_test_modules(source) == [
    (1, "sft_test"),
    (2, "decode_test"),
    (3, "kill_resume_test"),
    (4, "kill_resume_test"),
    (6, "lora_test"),
    (7, "dpo_test"),
    (8, "families_test"),
  ]


def test_no_module_of_the_tests_imports_a_test_module():
  modules = sorted(TESTS_DIR.glob("*.py"))
  assert len(modules) > 50 and TESTS_DIR / "helpers.py" in modules
  offenders = [
    f"{path.name}:{line} imports {name}"
    for path in modules
    for line, name in imported_test_modules(path.read_text(encoding="utf-8"))
  ]
  assert not offenders, (
    "a test module's names are imported from another module; move what they share to helpers.py or tiny_models.py:\n"
    + "\n".join(offenders)
  )
