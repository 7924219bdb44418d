"""train_compile.py's estimate against the seed's published MFU table (upstream README, "Runtime Performance Results").

    python3 benchmarks/aot_mfu_table.py [--rows 22b] [--libtpu-args] [--out table.md]

Each row compiles the published config (the MODEL_KEYS of MaxText/configs/v4/*.sh and v5e/*.sh) for its target
on this host (libtpu describes the TPUs; no TPU is needed), runs train_compile.py as a user would, and reads its
`Estimate: ... MFU x%` line. --libtpu-args sets the script's LIBTPU_INIT_ARGS too (the published runs had them).
Prints a markdown table: predicted and published MFU, their difference, the compile time, the time reading the
compiled step's operations and collectives, and the mean absolute error. Nothing is fitted to these rows.
"""

import argparse
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (model, script, topology, slices, published MFU %)
ROWS = [
  ("22b", "v4/22b.sh", "v4-128", 1, 56.7),
  ("22b", "v4/22b.sh", "v4-128", 2, 55.2),
  ("22b", "v4/22b.sh", "v4-128", 4, 54.3),
  ("22b", "v4/22b.sh", "v4-128", 8, 53.2),
  ("52b", "v4/52b.sh", "v4-384", 1, 56.0),
  ("52b", "v4/52b.sh", "v4-384", 2, 58.9),
  ("16b", "v5e/16b.sh", "v5e-256", 2, 57.8),
  ("32b", "v5e/32b.sh", "v5e-256", 2, 57.3),
]


def _script_values(script: str) -> tuple[list[str], str]:
  """(MODEL_KEYS, LIBTPU_INIT_ARGS) of a published-run script."""
  with open(os.path.join(REPO, "MaxText", "configs", script), encoding="utf-8") as f:
    text = f.read()
  keys = re.search(r"MODEL_KEYS=\((.*?)\)", text, re.S).group(1).split()
  flags = re.search(r'LIBTPU_INIT_ARGS="([^"]*)"', text)
  return keys, flags.group(1) if flags else ""


def run_row(row, libtpu_args: bool) -> dict:
  model, script, topology, slices, published = row
  keys, flags = _script_values(script)
  command = [
    sys.executable, "MaxText/train_compile.py", "MaxText/configs/base.yml", "dataset_type=synthetic", *keys,
    f"compile_topology={topology}", f"compile_topology_num_slices={slices}",
  ]  # fmt: skip
  env = {k: v for k, v in os.environ.items() if not k.startswith("M_")}
  if libtpu_args:
    env["LIBTPU_INIT_ARGS"] = flags
  else:
    env.pop("LIBTPU_INIT_ARGS", None)
  start = time.perf_counter()
  result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
  wall = time.perf_counter() - start
  out = result.stdout + result.stderr
  mfu = re.search(r"^Estimate: .* MFU ([\d.]+)%$", out, re.M)
  compile_s = re.search(r"^Compile time: ([\d.]+) s", out, re.M)
  parse_s = re.search(r"read in ([\d.]+) s", out)
  breakdown = re.search(r"^Step time breakdown: (.*)$", out, re.M)
  return {
    "row": f"{model} on {slices} x {topology}",
    "published": published,
    "predicted": float(mfu.group(1)) if mfu else None,
    "compile_s": float(compile_s.group(1)) if compile_s else None,
    "parse_s": float(parse_s.group(1)) if parse_s else None,
    "wall_s": wall,
    "breakdown": breakdown.group(1) if breakdown else out[-400:],
  }


def table(results: list[dict]) -> str:
  lines = [
    "| row | published MFU | predicted MFU | difference | compile (s) | parse (s) | whole run (s) |",
    "|---|---|---|---|---|---|---|",
  ]
  errors = []
  for r in results:
    if r["predicted"] is None:
      lines.append(f"| {r['row']} | {r['published']}% | failed | | | | {r['wall_s']:.0f} |")
      continue
    diff = r["predicted"] - r["published"]
    errors.append(abs(diff))
    lines.append(
      f"| {r['row']} | {r['published']}% | {r['predicted']}% | {diff:+.1f} | {r['compile_s']:.0f} | "
      f"{r['parse_s']:.1f} | {r['wall_s']:.0f} |"
    )
  if errors:
    lines.append(f"\nMean absolute error: {sum(errors) / len(errors):.1f} MFU points over {len(errors)} rows.")
  lines.append("\nBreakdowns:")
  lines += [f"- {r['row']}: {r['breakdown']}" for r in results]
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", default="", help="only rows whose name contains this, e.g. 22b or v5e")
  parser.add_argument("--libtpu-args", action="store_true", help="with the scripts' LIBTPU_INIT_ARGS")
  parser.add_argument("--out", default="", help="also write the table to this file")
  args = parser.parse_args()
  results = []
  for row in ROWS:
    if args.rows and args.rows not in f"{row[0]} {row[2]}":
      continue
    results.append(run_row(row, args.libtpu_args))
    print(f"{results[-1]['row']}: predicted {results[-1]['predicted']}%, published {row[4]}%", flush=True)
  text = table(results)
  print(text)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  main()
