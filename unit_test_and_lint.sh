#!/usr/bin/env bash
# The project's test command: format check, lint, then the unit tests (slow end-to-end tests are
# marked `slow` and left out here; run them with `python3 -m pytest -m slow`).
set -euo pipefail
cd "$(dirname "$0")"
python3 -m ruff format --check .
python3 -m ruff check .
python3 -m pytest "$@"
