"""Upstream MaxText's converter and checker scripts, which this project replaces, say what to run instead."""

import pytest

from MaxText.checkpoints import checkpointing
from MaxText.errors import UserError
from MaxText.hf_conversion import upstream_scripts
from MaxText.tests.helpers import run_python

SCRIPTS = [
  "MaxText/llama_or_mistral_ckpt.py",
  "MaxText/convert_gemma_chkpt.py",
  "MaxText/convert_gemma2_chkpt.py",
  "MaxText/convert_gpt3_ckpt_from_paxml.py",
  "MaxText/llama_mistral_mixtral_orbax_to_hf.py",
  "MaxText/tests/forward_pass_logit_checker.py",
]


@pytest.mark.parametrize("script", SCRIPTS)
def test_an_upstream_script_says_what_replaces_it(script):
  result = run_python([script, "--base-model-path", "x", "--maxtext-model-path", "y", "--model-size", "llama2-7b"])
  assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr
  line = result.stderr.strip()
  assert "\n" not in line and line.startswith(f"Error: {script.rsplit('/', 1)[-1]} is upstream MaxText's script")
  assert "convert_checkpoint.py" in line or "gpt3" in line
  assert set(upstream_scripts.REPLACEMENTS) == {s.rsplit("/", 1)[-1] for s in SCRIPTS}


def test_upstreams_converted_layout_points_at_the_params(tmp_path):
  (tmp_path / "params").mkdir()
  with pytest.raises(
    UserError,
    match=rf"convert_checkpoint.py writes its params to {tmp_path}/params .*load_parameters_path={tmp_path}/params$",
  ):
    checkpointing.tree_metadata(str(tmp_path / "0" / "items"), "load_parameters_path")
  with pytest.raises(UserError, match=r"does not exist$"):
    checkpointing.tree_metadata(str(tmp_path / "elsewhere" / "items"), "load_parameters_path")
