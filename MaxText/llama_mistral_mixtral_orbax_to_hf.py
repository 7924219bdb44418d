"""Upstream MaxText's llama_mistral_mixtral_orbax_to_hf.py, which this project replaces: running it says what to run
instead."""

import os
import sys

if __name__ == "__main__":
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  from MaxText.hf_conversion import upstream_scripts

  upstream_scripts.refuse(__file__)
