"""base.yml's per-key comments, written from the schema: a key's help lives once, in its `Key` (config_keys/).

Each key line of base.yml ends with `# <help>`, wrapped onto comment lines aligned under the `#`. Everything else
(the values, section headers, the notes above a group of keys) is base.yml's own and kept as it is.

    python3 -m MaxText.configuration.base_yml   # rewrites MaxText/configs/base.yml's key comments from the schema
"""

import re
import sys
import textwrap

from MaxText.configuration import config_schema
from MaxText.configuration.config_loader import BASE_YML

WIDTH = 118
NARROWEST = 48  # a help that would be narrower than this (after a long value) wraps at this width instead
_KEY_LINE = re.compile(r"^(?P<key>[a-z][a-z0-9_]*):(?P<value>.*)$")


def _value_and_comment(rest: str) -> tuple[str, str]:
  """Splits what follows `key:` into its YAML value and its trailing comment, outside quotes."""
  quote = None
  for i, char in enumerate(rest):
    if quote:
      quote = None if char == quote else quote
    elif char in "\"'":
      quote = char
    elif char == "#" and (i == 0 or rest[i - 1] in " \t"):
      return rest[:i].rstrip(), rest[i:]
  return rest.rstrip(), ""


def _key_lines(key: str, value: str, help_text: str) -> list[str]:
  head = f"{key}:{value}  # "
  column = len(head) - 2
  lines = textwrap.wrap(help_text, width=max(WIDTH - len(head), NARROWEST), break_on_hyphens=False)
  return [head + lines[0]] + [" " * column + "# " + line for line in lines[1:]]


def render(text: str, keys=None) -> str:
  """`text` (base.yml) with each key line's comment made its Key.help; the rest as it was."""
  keys = config_schema.KEYS if keys is None else keys
  lines = text.split("\n")
  out, i = [], 0
  while i < len(lines):
    match = _KEY_LINE.match(lines[i])
    if not match or match["key"] not in keys:
      out.append(lines[i])
      i += 1
      continue
    value, comment = _value_and_comment(match["value"])
    out.extend(_key_lines(match["key"], value, keys[match["key"]].help))
    i += 1
    column = len(match["key"]) + 1 + len(value) + 2
    while comment and i < len(lines) and re.match(rf"^ {{{column}}}#", lines[i]):  # the old help's wrapped lines
      i += 1
  return "\n".join(out)


def main() -> None:
  with open(BASE_YML, encoding="utf-8") as f:
    text = f.read()
  new = render(text)
  if new != text:
    with open(BASE_YML, "w", encoding="utf-8") as f:
      f.write(new)
  print(f"{BASE_YML}: {'rewritten' if new != text else 'already'} from the schema's help")


if __name__ == "__main__":
  sys.exit(main())
