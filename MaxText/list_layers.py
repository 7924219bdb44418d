"""Lists the model's dense layers by the names that numerics_debug_config selects:

    python3 MaxText/list_layers.py MaxText/configs/base.yml [key=value ...]

One line per dense layer (scanned layers expanded by index): its name (e.g. decoder.layers.4.self_attention.out,
what layer_name_regex_pattern matches in full), its layer number (counted from 1, what layer_numbers selects),
its type (what layer_types selects) and its kernel's shape. With numerics_debug_config=<file> it also names the
enabled sections that select each layer, and with quantization=int8|int8w|int4w|intmp|fp8 how each layer's GEMMs run (e.g.
"fp8: fprop dgrad, wgrad high"). Nothing is allocated: the model is traced on shapes only.
"""

import os
import sys

if __package__ in (None, ""):  # Run as `python3 MaxText/list_layers.py`: import MaxText from this checkout.
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from MaxText import pyconfig  # pylint: disable=wrong-import-position
from MaxText.runtime.entry_point import run_and_exit_on_user_error  # pylint: disable=wrong-import-position


def layer_lines(config, params) -> list[str]:
  """The listing of the dense layers of `params` (arrays or shapes), one line each, after a header."""
  # pylint: disable=import-outside-toplevel
  from MaxText.diagnostics import numerics_log
  from MaxText.layers import layer_names, quantizations

  numerics = config.numerics_debug
  quant = quantizations.from_config(config)
  layers = layer_names.dense_layers(params, config)
  numerics_log.warn_unmatched_sections(numerics, layers)
  rows = [["name", "number", "type", "kernel shape"] + ["sections"] * bool(numerics) + ["quantization"] * bool(quant)]
  for layer in layers:
    row = [layer.name, "-" if layer.number is None else str(layer.number), layer.type or "-", str(list(layer.kernel_shape))]
    if numerics:
      row.append(", ".join(s.name for s in numerics.sections_for(layer.name)) or "-")
    if quant:
      row.append(quantizations.describe(quant.mode, quant.recipe(layer.name)))
    rows.append(row)
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  aligned = [[cell.rjust(w) if i == 1 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))] for row in rows]
  return ["  ".join(cells).rstrip() for cells in aligned]


def main(argv: list[str]) -> None:
  config = pyconfig.initialize(argv, reads_data=False)
  # pylint: disable=import-outside-toplevel
  from MaxText.runtime.mesh import create_device_mesh
  from MaxText.training import training_setup

  setup = training_setup.build(config, create_device_mesh(config), params_only=True, check_memory=False)
  print("\n".join(layer_lines(config, setup.abstract_state.params)))


if __name__ == "__main__":
  run_and_exit_on_user_error(main, sys.argv)
