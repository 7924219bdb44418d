#!/usr/bin/env bash
# The project's test command: format check, lint, then the unit tests (slow end-to-end tests are
# marked `slow` and left out here; run them with `python3 -m pytest -m slow`).
set -euo pipefail
cd "$(dirname "$0")"
python3 -m ruff format --check .
python3 -m ruff check .
# Two worker processes (a file's tests in the same one, with its module fixtures): most of a test's time is one
# thread compiling, or waiting for a child process.
python3 -m pytest -n 2 --dist loadfile "$@"
