"""A PNG of loss, eval loss, learning rate, tokens/s and MFU over steps, from metrics files or a run's history.

For users without TensorBoard at hand: `python3 MaxText/plot_metrics.py METRICS_FILE... --output PNG` compares
runs, and train.py writes <run_dir>/metrics.png at the end of a run. Matplotlib draws with its Agg backend (no
display needed) and is imported only when a plot is drawn.
"""

import io
import json
import os

from MaxText import max_logging
from MaxText.errors import UserError

LOSS, EVAL_LOSS = "learning/loss", "eval/loss"
LEARNING_RATE, TOKENS_PER_SEC, MFU = "learning/current_learning_rate", "perf/per_device_tokens_per_sec", "perf/mfu"
KEYS = (LOSS, EVAL_LOSS, LEARNING_RATE, TOKENS_PER_SEC, MFU)
_MAX_POINTS = 4096  # a run's history keeps at most about twice this many train steps, evenly spread


class History:
  """The plotted values of a run's steps, in memory, for the end-of-run plot when there is no metrics file.

  Past 2 x _MAX_POINTS train steps it keeps every other one (and from then on every 2nd, 4th, ... step), so that a
  run of any length costs at most a few MB; evals are few and all kept.
  """

  def __init__(self):
    self.records = []
    self._stride, self._seen, self._train = 1, 0, 0

  def add(self, step: int, metrics: dict) -> None:
    """Keeps the plotted values of a written step (or of an eval) from a dict of floats."""
    record = {"step": step, **{k: float(metrics[k]) for k in KEYS if k in metrics}}
    if EVAL_LOSS in record:
      self.records.append(record)
      return
    self._seen += 1
    if (self._seen - 1) % self._stride:
      return
    self.records.append(record)
    self._train += 1
    if self._train > 2 * _MAX_POINTS:
      dropped = {id(r) for r in [r for r in self.records if EVAL_LOSS not in r][1::2]}
      self.records = [r for r in self.records if id(r) not in dropped]
      self._train -= len(dropped)
      self._stride *= 2


def read_metrics_file(path: str) -> list[dict]:
  """The records of a metrics file (JSON lines with "step", as metrics_file= writes), or UserError naming the problem.

  A line cut short at the end (a run still writing, or killed) is skipped; other lines that are not metrics are
  skipped with one warning, unless no line is one.
  """
  if not os.path.exists(path):
    raise UserError(f"metrics file {path} does not exist")
  if os.path.isdir(path):
    raise UserError(f"metrics file {path} is a directory; give the JSON-lines file that metrics_file= wrote")
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.read().split("\n")
  except (OSError, UnicodeDecodeError) as e:
    raise UserError(f"metrics file {path} cannot be read as text: {e}") from None
  records, bad = [], []
  for number, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      if number == len(lines):  # the last line, without its newline: being written
        continue
      bad.append((number, "not JSON"))
      continue
    if not isinstance(record, dict) or not isinstance(record.get("step"), (int, float)):
      bad.append((number, "not an object with a numeric 'step'"))
    elif not any(isinstance(record.get(k), (int, float)) for k in KEYS):
      bad.append((number, f"an object with none of {', '.join(KEYS)}"))
    else:
      records.append(record)
  if not records:
    if not bad:
      raise UserError(f"metrics file {path} is empty: it has no metrics lines yet")
    number, problem = bad[0]
    raise UserError(
      f"{path} is not a metrics file: line {number} is {problem} (metrics_file= writes one JSON object per step, "
      "with 'step' and 'learning/loss')"
    )
  if bad:
    max_logging.warn(f"{path}: skipped {len(bad)} lines that are not metrics (line {bad[0][0]}: {bad[0][1]})")
  return records


def _series(records: list[dict], key: str, scale: float = 1.0) -> tuple[list, list]:
  points = [(r["step"], r[key] * scale) for r in records if isinstance(r.get(key), (int, float))]
  return [p[0] for p in points], [p[1] for p in points]


FORMATS = ("png", "pdf", "svg")


def draw(runs: dict, title: str = "MaxText metrics", image_format: str = "png", extra_keys: tuple = ()) -> bytes:
  """The image (bytes) of the runs' metrics: loss and eval loss, learning rate, tokens/s per device, MFU, and a panel
  for each of extra_keys.

  Args:
    runs: label -> records (dicts with "step" and any of KEYS), one line per run in each panel.
    title: the figure's title.
    image_format: one of FORMATS.
    extra_keys: more metrics to plot, a panel each after the four (a feature's, e.g. GRPO's rl/reward_mean).
  """
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel

  rows = 2 + (len(extra_keys) + 1) // 2
  fig, axes = plt.subplots(rows, 2, figsize=(13, 4.25 * rows), sharex=True, squeeze=False)
  panels = [
    (axes[0][0], "Loss (solid: train, dashed with dots: eval)", LOSS, 1.0),
    (axes[0][1], "Learning rate", LEARNING_RATE, 1.0),
    (axes[1][0], "Tokens/s per device", TOKENS_PER_SEC, 1.0),
    (axes[1][1], "MFU (%)", MFU, 100.0),
  ]
  panels += [(axes[2 + i // 2][i % 2], key, key, 1.0) for i, key in enumerate(extra_keys)]
  if len(extra_keys) % 2:
    axes[-1][1].set_visible(False)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for i, (label, records) in enumerate(runs.items()):
    color = colors[i % len(colors)]
    for ax, _, key, scale in panels:
      steps, values = _series(records, key, scale)
      if steps:
        ax.plot(steps, values, color=color, linewidth=1.2, label=label)
    steps, values = _series(records, EVAL_LOSS)
    if steps:
      axes[0][0].plot(steps, values, color=color, linestyle="--", marker="o", markersize=4, label=f"{label} (eval)")
  for ax, name, key, _ in panels:
    ax.set_title(name)
    ax.grid(True, alpha=0.3)
    if not ax.lines:
      why = " (no peak TFLOP/s known for these devices, e.g. CPU)" if key == MFU else ""
      ax.text(0.5, 0.5, f"not in these metrics{why}", ha="center", va="center", transform=ax.transAxes, color="gray")
      ax.set_yticks([])
  for ax in axes[-1]:
    ax.set_xlabel("step")
  axes[0][1].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
  if axes[0][0].lines:
    axes[0][0].legend(fontsize=8)
  fig.suptitle(title)
  fig.tight_layout()
  buffer = io.BytesIO()
  fig.savefig(buffer, format=image_format, dpi=100)
  plt.close(fig)
  return buffer.getvalue()


def runs_of_files(paths: list[str]) -> dict[str, list[dict]]:
  """label -> records of every run in the files (a file that several runs shared holds several, by run_name).

  A label is the run_name (a file's name where its lines have none), or path:run_name where two would read the
  same. A file given twice counts once.
  """
  found = []  # (path, run_name or None, records)
  for path in dict.fromkeys(paths):
    by_run = {}
    for record in read_metrics_file(path):
      by_run.setdefault(record.get("run_name"), []).append(record)
    found += [(path, name, records) for name, records in by_run.items()]
  names = [os.path.basename(path) if name is None else str(name) for path, name, _ in found]
  labels = [f"{path}:{name}" if names.count(name) > 1 else name for (path, _, _), name in zip(found, names)]
  return {label: records for label, (_, _, records) in zip(labels, found)}


def write_run_plot(config, history: History) -> None:
  """At the end of a run, process 0 writes <run_dir>/metrics.png: from the metrics file (all of the run, restarts
  included) when there is one, else from this process's history. A failure is a warning: training is done."""
  import jax  # pylint: disable=import-outside-toplevel
  from etils import epath  # pylint: disable=import-outside-toplevel

  if jax.process_index() != 0:
    return
  path = epath.Path(config.run_dir) / "metrics.png"
  try:
    if config.metrics_file:  # this run's lines (the file may be shared with other runs)
      records = [r for r in read_metrics_file(config.metrics_file) if r.get("run_name", config.run_name) == config.run_name]
    else:
      records = history.records
    if not records:
      return
    path.write_bytes(draw({config.run_name: records}, title=f"MaxText run {config.run_name}"))
  except Exception as e:  # pylint: disable=broad-except
    max_logging.warn(f"could not write the metrics plot {path}: {type(e).__name__}: {e}")
    return
  max_logging.log(f"Plot of loss, eval loss, learning rate, tokens/s and MFU: {path}")
