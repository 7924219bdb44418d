"""Upstream MaxText's tests/forward_pass_logit_checker.py, which this project replaces: running it says what to run
instead (the converter's --check_logits)."""

import os
import sys

if __name__ == "__main__":
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from MaxText.hf_conversion import upstream_scripts

  upstream_scripts.refuse(__file__)
