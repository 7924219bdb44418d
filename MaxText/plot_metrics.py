"""Plots loss, eval loss, learning rate, tokens/s and MFU over steps from metrics files, several to compare:

    python3 MaxText/plot_metrics.py maxtext_output/a/metrics.jsonl maxtext_output/b/metrics.jsonl --output ab.png

--metric KEY adds a panel for any other metric in the files, such as GRPO's rl/reward_mean.

A metrics file is what metrics_file=... writes during training (one JSON object per step; the steps followed by an
eval also hold eval/loss). Each run is a line in every panel, labelled by its run_name (a file that several runs
shared gives a line per run). --output may name a .png, .pdf or .svg file.
"""

import argparse
import os
import sys

if __package__ in (None, ""):  # Run as `python3 MaxText/plot_metrics.py`: import MaxText from this checkout.
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from MaxText import max_logging  # pylint: disable=wrong-import-position
from MaxText.diagnostics import plots  # pylint: disable=wrong-import-position
from MaxText.errors import UserError  # pylint: disable=wrong-import-position
from MaxText.runtime.entry_point import run_and_exit_on_user_error  # pylint: disable=wrong-import-position


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(prog="plot_metrics.py", description=__doc__.split("\n\n", 1)[0])
  parser.add_argument("metrics_files", nargs="+", metavar="METRICS_FILE", help="JSON-lines files from metrics_file=")
  parser.add_argument(
    "--output", default="metrics.png", help="the image to write: .png (default: metrics.png), .pdf or .svg"
  )
  parser.add_argument("--title", default="MaxText metrics", help="the figure's title")
  parser.add_argument(
    "--metric",
    action="append",
    default=[],
    metavar="KEY",
    help="one more metric to plot, a panel of its own, e.g. --metric rl/reward_mean (GRPO's reward); repeat for more",
  )
  args = parser.parse_args(argv[1:])
  image_format = os.path.splitext(args.output)[1][1:].lower()
  if image_format not in plots.FORMATS:
    raise UserError(f"--output {args.output}: name a .png, .pdf or .svg file")
  runs = plots.runs_of_files(args.metrics_files)
  for key in args.metric:
    if not any(isinstance(r.get(key), (int, float)) for records in runs.values() for r in records):
      found = sorted(
        {k for records in runs.values() for r in records for k in r if k != "step" and isinstance(r[k], (int, float))}
      )
      more = f", ... ({len(found)} in all)" if len(found) > 12 else ""
      raise UserError(f"--metric {key} is in none of these metrics files; they have {', '.join(found[:12])}{more}")
  image = plots.draw(runs, title=args.title, image_format=image_format, extra_keys=tuple(dict.fromkeys(args.metric)))
  try:
    with open(args.output, "wb") as f:
      f.write(image)
  except OSError as e:
    raise UserError(f"--output {args.output} cannot be written: {e.strerror or e}") from None
  steps = sum(len(r) for r in runs.values())
  max_logging.log(f"Wrote {args.output}: {len(runs)} run(s), {steps} metrics lines")


if __name__ == "__main__":
  run_and_exit_on_user_error(main, sys.argv)
