#!/usr/bin/env bash
# Kills a 40-step run with SIGKILL at three points (one during an async checkpoint save), restarts it
# each time with the same command, and checks that the per-step losses are bitwise those of an
# uninterrupted run; on 1 device and on 8 simulated devices.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pytest -m slow -s MaxText/tests/kill_resume_test.py
