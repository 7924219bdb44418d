"""Writes the numerics statistics of selected layers, in TransformerEngine's debug-module layout under the run dir.

- <run_dir>/debug_statistics_logs/numerics_statistics.jsonl: one JSON object per value,
  {"step", "layer", "tensor", "stat", "value"}, for the steps each statistics feature asks for; also TensorBoard
  scalars `numerics/<layer>/<tensor>/<stat>`.
- <run_dir>/debug_logs/: numerics_debug_config.yml (the parsed config, every default written out) and
  selected_layers.txt (each section's layers and features).

Process 0 writes them (the statistics are of the global arrays, the same on every process).
"""

import json
import os

import jax
import yaml
from etils import epath

from MaxText import max_logging
from MaxText.diagnostics import metrics_file, numerics_config, numerics_stats
from MaxText.errors import UserError
from MaxText.layers import layer_names

STATS_DIR = "debug_statistics_logs"
STATS_FILE = "numerics_statistics.jsonl"
DEBUG_DIR = "debug_logs"


class StatsWriter:
  """Writes each reported step's statistics (a MetricLogger observer)."""

  def __init__(self, plan: numerics_stats.Plan, path: str | None, writer=None):
    self.plan = plan
    self.path = path
    self.writer = writer

  def __call__(self, step: int, scalars: dict, nested: dict) -> None:
    del scalars
    if not self.plan.active(step):
      return
    rows = self.plan.rows(step, nested[numerics_stats.METRICS_KEY])
    if self.path is not None:
      with open(self.path, "a", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    if self.writer is not None:
      for row in rows:
        self.writer.add_scalar(f"numerics/{row['layer']}/{row['tensor']}/{row['stat']}", row["value"], step)


def _feature_line(feature: numerics_config.StatsFeature) -> str:
  end = "" if feature.end_step < 0 else str(feature.end_step)
  return (
    f"  {feature.feature}: {', '.join(feature.tensors)} x {', '.join(feature.stats)}; every {feature.freq} steps "
    f"from {feature.start_step} to {end or 'the end'}"
  )


def selected_layers_text(numerics: numerics_config.NumericsDebugConfig, dense_layers) -> str:
  """Each section, its features and the dense layers it selects (name, type), as debug_logs/selected_layers.txt."""
  lines = []
  for section in numerics.sections:
    selected = [layer for layer in dense_layers if section.layers.matches(layer.name)]
    state = "" if section.enabled else " (disabled)"
    lines.append(f"section '{section.name}'{state}: {len(selected)} dense layers")
    lines += [_feature_line(feature) for feature in section.stats]
    for gemm in numerics_config.GEMMS:
      if section.disable_fp8_layer or gemm in section.disable_fp8_gemm:
        lines.append(f"  {gemm}: high precision")
      elif gemm in section.per_tensor_scaling:
        lines.append(f"  {gemm}: per-tensor current scaling, margin {section.per_tensor_scaling_margin}")
    lines += [f"    {layer.name}  {layer.type or '-'}" for layer in selected]
  return "\n".join(lines) + "\n"


def _write_debug_logs(config, numerics, dense_layers) -> None:
  directory = epath.Path(config.run_dir) / DEBUG_DIR
  directory.mkdir(parents=True, exist_ok=True)
  parsed = yaml.safe_dump(numerics.to_plain(), sort_keys=False, default_flow_style=None)
  (directory / "numerics_debug_config.yml").write_text(
    f"# Parsed from numerics_debug_config={config.numerics_debug_config}\n{parsed}"
  )
  (directory / "selected_layers.txt").write_text(selected_layers_text(numerics, dense_layers))


def warn_unmatched_sections(numerics, dense_layers) -> None:
  """A warning for each enabled section that selects none of the model's dense layers (a typo in a regex, say)."""
  for section in numerics.sections:
    if section.enabled and not any(section.layers.matches(layer.name) for layer in dense_layers):
      max_logging.warn(
        f"numerics_debug_config section '{section.name}' selects no layer (layer_name_regex_pattern must match a "
        "whole name); the names are those of python3 MaxText/list_layers.py <config> [key=value ...]"
      )


def observers(config, params, writer, start_step: int) -> list:
  """The MetricLogger observer that writes the statistics (none when numerics_debug_config asks for none).

  Also writes debug_logs/ and warns about sections that select no layer.

  Args:
    config: the Config.
    params: the params (or their shapes), for the layer names.
    writer: the TensorBoard writer (None: none).
    start_step: the first step of this run: a resumed run drops the file's lines from this step on.
  """
  numerics = config.numerics_debug
  if not numerics:
    return []
  dense_layers = layer_names.dense_layers(params, config)
  warn_unmatched_sections(numerics, dense_layers)
  plan = numerics_stats.create_plan(config, params)
  if jax.process_index() != 0:
    return []
  path = os.path.join(config.run_dir, STATS_DIR, STATS_FILE)
  remote = "://" in config.run_dir  # a JSON-lines file is appended to: local run directories only
  try:
    _write_debug_logs(config, numerics, dense_layers)
    if plan is not None and not remote:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      metrics_file.keep_lines_before(path, start_step)  # the metrics file's resume rule
  except OSError as e:
    raise UserError(f"numerics_debug_config: cannot write under the run directory {config.run_dir}: {e}") from None
  if plan is None:
    return []
  where = "TensorBoard (the run directory is remote)" if remote else path
  max_logging.log(
    f"Numerics statistics of {len(plan.selected_layers())} dense layers go to {where} (layers and config: "
    f"{os.path.join(config.run_dir, DEBUG_DIR)})"
  )
  return [StatsWriter(plan, None if remote else path, writer)]
