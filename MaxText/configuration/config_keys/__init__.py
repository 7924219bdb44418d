"""The vocabulary of the config schema: `Key`, `Range` and `On`. The modules of this package declare one `Key` per
key of MaxText/configs/base.yml, section by section; `MaxText.configuration.config_schema` gathers them.

A key's default (and so its type) stays in base.yml; an entry says what a default cannot:

    "adam_b2": Key("Adam's second-moment decay.", range=Range(0, 1, high_open=True)),
    "profiler_steps": Key("Steps profiled.", range=POSITIVE, acts_with=On("profiler", "xplane", "nsys")),
"""

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Range:
  """The numbers a key takes: low..high, each end inclusive unless open, plus the special values in `also` (-1, null).

  `says` replaces the generated description (">= 0", "in [0, 1)", "a positive integer") in error messages and --help,
  where a special value or a bound needs its meaning said, or where a check in config_validation narrows the range.
  """

  low: float = -math.inf
  high: float = math.inf
  low_open: bool = False
  high_open: bool = False
  also: tuple = ()
  says: str = ""

  def contains(self, x, integer: bool = False) -> bool:
    """Whether x is in the range (NaN never is); integer: x must also be an int."""
    if any(x is a or (type(x) is type(a) and x == a) for a in self.also):
      return True
    if isinstance(x, bool) or not isinstance(x, int if integer else (int, float)) or math.isnan(x):
      return False
    above = x > self.low if self.low_open else x >= self.low
    below = x < self.high if self.high_open else x <= self.high
    return above and below

  def describe(self, integer: bool = False) -> str:
    """What a valid value is, as in `steps=0 must be <this>`."""
    if self.says:
      return self.says
    if integer and (self.low, self.low_open, self.high) == (1, False, math.inf):
      return "a positive integer"
    if self.high == math.inf:
      return f"{'>' if self.low_open else '>='} {self.low:g}"
    if self.low == -math.inf:
      return f"{'<' if self.high_open else '<='} {self.high:g}"
    return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


POSITIVE = Range(1)  # of an integer key: "a positive integer"
NON_NEGATIVE = Range(0)
FRACTION = Range(0, 1)


@dataclasses.dataclass(frozen=True, init=False)
class On:
  """A switch and the values that turn it on, for keys that act only then: On("profiler", "xplane", "nsys")."""

  key: str
  values: tuple

  def __init__(self, key: str, *values):
    object.__setattr__(self, "key", key)
    object.__setattr__(self, "values", values)

  def is_on(self, value) -> bool:
    return value in self.values

  def __str__(self) -> str:
    return f"{self.key}={'|'.join(str(v).lower() if isinstance(v, bool) else str(v) for v in self.values)}"


@dataclasses.dataclass(frozen=True)
class Key:
  """One config key.

  Attributes:
    help: one line: what the key does, and what special values (0, -1, "") mean.
    choices: the values it takes; for a list key, the names its items take.
    range: the numbers it takes.
    acts_with: the switch without which it has no effect (setting it with the switch off is warned about).
    kind: its type where base.yml's default (null) cannot give it; otherwise the default's type is the key's.
    refused: for an upstream MaxText key accepted only at its default: why another value does not apply here, and
      what to use instead (the error line).
  """

  help: str
  choices: tuple = ()
  range: Range | None = None
  acts_with: On | None = None
  kind: str = ""
  refused: str = ""

  def describe_choices(self) -> str:
    return ", ".join('"" (none)' if c == "" else str(c) for c in self.choices)
