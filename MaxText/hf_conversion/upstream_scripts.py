"""Upstream MaxText's conversion and checking scripts that this project replaces: running one of them (a file of the
same name here) says, in one line, what to run instead, rather than Python's "can't open file"."""

import os
import sys

_TO_MAXTEXT = (
  "python3 MaxText/convert_checkpoint.py to_maxtext --hf_path <Hugging Face model dir> --output_dir OUT "
  "[--check_logits], then train or decode with load_parameters_path=OUT/params (docs/huggingface.md)"
)
REPLACEMENTS = {
  "llama_or_mistral_ckpt.py": "it converts Meta's and Mistral's original PyTorch files; here the same models convert "
  f"from their Hugging Face checkpoints: {_TO_MAXTEXT}",
  "convert_gemma_chkpt.py": f"it converts Gemma's Flax files; here Gemma converts from Hugging Face: {_TO_MAXTEXT}",
  "convert_gemma2_chkpt.py": f"it converts Gemma 2's Flax files; here from Hugging Face: {_TO_MAXTEXT}",
  "convert_gpt3_ckpt_from_paxml.py": "it converts Paxml GPT-3 checkpoints, which this project does not read; gpt3 presets "
  "train from scratch (model_name=gpt3-52k, gpt3-6b, gpt3-22b, gpt3-175b)",
  "llama_mistral_mixtral_orbax_to_hf.py": "here: python3 MaxText/convert_checkpoint.py to_hf --maxtext_dir <run dir, or a "
  "to_maxtext output> --output_dir HF_OUT [--check_logits] (docs/huggingface.md)",
  "forward_pass_logit_checker.py": "here the converter checks logits against transformers itself: add --check_logits to "
  "python3 MaxText/convert_checkpoint.py to_maxtext or to_hf (docs/huggingface.md)",
}


def refuse(script_path: str) -> None:
  """Exits with the one line that says what replaces upstream's script (status 2, as a config mistake)."""
  name = os.path.basename(script_path)
  sys.stderr.write(f"Error: {name} is upstream MaxText's script, not this project's: {REPLACEMENTS[name]}\n")
  sys.exit(2)
