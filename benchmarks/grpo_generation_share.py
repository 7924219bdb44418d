"""How a GRPO step's time splits between generating a round and training, from a run with num_iterations=2:

    SEED=0 bash end_to_end/grpo_toy/run.sh /tmp/grpo_toy   # makes the task and the SFT checkpoint
    python3 MaxText/train.py ... (run.sh's GRPO command) num_iterations=2 steps=80 metrics_file=/tmp/it2.jsonl
    python3 benchmarks/grpo_generation_share.py /tmp/it2.jsonl

With num_iterations=2 a round is generated before every even step, and the odd steps reuse it. The step line's
seconds run from one step's metrics to the next's, and the metrics of step k are written once step k+1 is
dispatched, so the round generated before an even step falls in the odd step's time: the odd steps' median minus
the even steps' is the generation, the even steps' median the training. The first `--skip` steps (compiling) are
left out.
"""

import argparse
import json

import numpy as np


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  parser.add_argument("metrics_file", help="the metrics file of a GRPO run with num_iterations=2")
  parser.add_argument("--skip", type=int, default=10, help="first steps to leave out (default 10)")
  args = parser.parse_args()
  with open(args.metrics_file, encoding="utf-8") as f:
    records = [json.loads(line) for line in f if line.strip()][args.skip :]
  seconds = {parity: [r["perf/step_time_seconds"] for r in records if int(r["step"]) % 2 == parity] for parity in (0, 1)}
  training, with_generation = float(np.median(seconds[0])), float(np.median(seconds[1]))
  generation = with_generation - training
  print(f"steps: {len(records)}; training a step: {training * 1e3:.1f} ms; generating a round: {generation * 1e3:.1f} ms")
  print(f"generation's share of a step that generates: {generation / with_generation:.0%}")


if __name__ == "__main__":
  main()
