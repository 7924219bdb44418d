"""One entry per config key: its allowed values or range, the switch it acts with, and one line of help.

    config_schema.KEYS["adam_b2"]  # Key(help="Adam's second-moment decay.", range=Range(0, 1, high_open=True))

MaxText/configs/base.yml holds every default, and so every type; the modules of MaxText/configuration/config_keys/
declare the rest, section by section in base.yml's order. config_validation checks the choices and ranges, pyconfig
warns about keys set while their switch is off, and `--help` of the entry points prints it all (print_help).
Pure Python: no JAX.
"""

import sys

import yaml

from MaxText.configuration import config_loader
from MaxText.configuration.config_keys import Key, On, data, mesh, model, multimodal, rl, run, tools, training, upstream

SECTIONS: dict[str, dict[str, Key]] = {
  **run.SECTIONS,
  **model.SECTIONS,
  **multimodal.SECTIONS,
  **mesh.SECTIONS,
  **training.SECTIONS,
  **rl.SECTIONS,
  **data.SECTIONS,
  **tools.SECTIONS,
  **upstream.SECTIONS,
}
KEYS: dict[str, Key] = {name: key for keys in SECTIONS.values() for name, key in keys.items()}

_KINDS = {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "mapping"}


def kind(name: str, default) -> str:
  """A key's type: its entry's kind where it gives one (the default is null), else the type of its base.yml default."""
  return KEYS[name].kind or _KINDS.get(type(default), "any")


def switches() -> dict[On, list[str]]:
  """Each switch, and the keys that act only while it is on, in base.yml's order."""
  found = {}
  for name, key in KEYS.items():
    if key.acts_with is not None:
      found.setdefault(key.acts_with, []).append(name)
  return found


def _show_default(value) -> str:
  """A default as YAML writes it; a long list shortened to its first items."""
  if value == "":
    return '""'
  text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()
  if isinstance(value, list) and len(text) > 90:
    for n in range(len(value) - 1, 0, -1):
      text = yaml.safe_dump(value[:n], default_flow_style=True, width=10_000).strip()
      if len(text) <= 70:
        break
    text = f"{text[:-1]}, ...] (base.yml)"
  return text


def _constraint(name: str, key: Key, default) -> str:
  if key.choices:
    return f"{'items from' if isinstance(default, list) else 'one of'}: {key.describe_choices()}"
  if key.range is not None:
    return key.range.describe(integer=kind(name, default) == "int")
  return ""


def format_help() -> str:
  """Every key, grouped by section: name, type, default, allowed values or range, the switch it acts with, help."""
  defaults = config_loader.base_defaults()
  lines = [
    "Config keys. Their defaults are those of MaxText/configs/base.yml; key=value after the config file, or",
    "M_<KEY>=value in the environment, overrides one; model_name=<name> loads MaxText/configs/models/<name>.yml.",
  ]
  for section, keys in SECTIONS.items():
    lines += ["", f"{section}:"]
    for name, key in keys.items():
      facts = [f"{name}: {kind(name, defaults[name])} = {_show_default(defaults[name])}"]
      facts.append(_constraint(name, key, defaults[name]))
      facts.append(f"acts only with {key.acts_with}" if key.acts_with else "")
      facts.append("upstream's default only" if key.refused else "")
      lines += ["  " + "; ".join(fact for fact in facts if fact), f"      {key.help}"]
  return "\n".join(lines) + "\n"


def print_help(file=None) -> None:
  """Prints format_help() (to stdout by default): the `--help` of the entry points that take a config."""
  (file or sys.stdout).write(format_help())
