#!/usr/bin/env bash
# Runs the README quickstart exactly as written and checks it: under 5 minutes on 2 CPU cores, and the
# mean loss of the last 5 steps at most 70% of the first step's loss.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pytest -m slow -s MaxText/tests/quickstart_test.py
