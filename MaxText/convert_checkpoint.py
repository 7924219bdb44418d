"""Converts checkpoints between Hugging Face and MaxText, tensor by tensor (host memory stays near one tensor).

    python3 MaxText/convert_checkpoint.py to_maxtext --hf_path HF_DIR --output_dir OUT [--check_logits]
    python3 MaxText/convert_checkpoint.py to_hf --maxtext_dir OUT --output_dir HF_OUT [--check_logits]

to_maxtext reads a local Hugging Face model directory (config.json, safetensors shards or torch .bin shards,
tokenizer files) and writes OUT/model.yml (the architecture as MaxText config keys; use it as the config
file), OUT/params (an Orbax params checkpoint for load_parameters_path) and the tokenizer files.
to_hf reads such a directory, or a training run's directory (<base_output_directory>/<run_name>, its latest
checkpoint), and writes config.json, safetensors and the tokenizer files that
transformers.AutoModelForCausalLM.from_pretrained loads. A LoRA run's directory gives PEFT's adapter files
(adapter_config.json, adapter_model.safetensors) for peft.PeftModel.from_pretrained on the HF base; --merge_lora
writes the run's base (its load_parameters_path) with the adapters merged instead. to_maxtext --peft_adapter DIR
also reads a PEFT LoRA adapter of the --hf_path model: its adapters join OUT/params and model.yml turns LoRA on.
--check_logits runs both implementations in float32 on fixed random tokens and prints
`logit check: max_abs_diff=<x> kl=<y>`; it fails above 1e-3 (needs torch and transformers).
Families: llama (Llama 2, 3, 3.1), mistral, mixtral, gemma, gemma2, gemma3 (text), qwen3, qwen3_moe, deepseek (V3).
"""

import argparse
import os
import sys

if __package__ in (None, ""):  # Run as `python3 MaxText/convert_checkpoint.py`: import MaxText from this checkout.
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from MaxText.errors import UserError  # pylint: disable=wrong-import-position
from MaxText.runtime.entry_point import run_and_exit_on_user_error  # pylint: disable=wrong-import-position


class _Parser(argparse.ArgumentParser):
  def error(self, message):
    raise UserError(f"{message} (usage: see python3 MaxText/convert_checkpoint.py --help)")


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = _Parser(prog="convert_checkpoint.py")
  commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
  to_maxtext = commands.add_parser("to_maxtext", help="Hugging Face directory -> MaxText directory")
  to_maxtext.add_argument("--hf_path", required=True, help="a local Hugging Face model directory")
  to_maxtext.add_argument("--output_dir", required=True, help="receives model.yml, params/ and the tokenizer files")
  to_maxtext.add_argument("--check_logits", action="store_true", help="compare logits with transformers (float32)")
  to_maxtext.add_argument("--peft_adapter", default="", help="a PEFT LoRA adapter of the --hf_path model to read in too")
  to_hf = commands.add_parser("to_hf", help="MaxText directory -> Hugging Face directory")
  to_hf.add_argument("--maxtext_dir", required=True, help="a to_maxtext output, or a training run's directory")
  to_hf.add_argument("--output_dir", required=True, help="receives config.json, safetensors and tokenizer files")
  to_hf.add_argument("--check_logits", action="store_true", help="compare logits with transformers (float32)")
  to_hf.add_argument(
    "--merge_lora", action="store_true", help="a LoRA run: its adapters merged into its base (default: PEFT adapter files)"
  )
  return parser.parse_args(argv)


def main(argv: list[str]) -> None:
  args = parse_args(argv[1:])
  # pylint: disable=import-outside-toplevel
  from MaxText.hf_conversion import converter, logit_check

  if args.check_logits:
    logit_check.require_torch()  # fail before converting, not after
  if args.command == "to_maxtext":
    model_yml = converter.to_maxtext(args.hf_path, args.output_dir, args.peft_adapter)
    print(f"Wrote {model_yml} and {os.path.join(args.output_dir, converter.PARAMS_DIR)}", flush=True)
    if args.check_logits:
      config = converter.maxtext_config(model_yml)
      logit_check.check(args.hf_path, model_yml, os.path.join(args.output_dir, converter.PARAMS_DIR), config.vocab_size)
  else:
    model_yml = os.path.join(args.maxtext_dir, converter.MODEL_YML)
    if args.check_logits and not os.path.isfile(model_yml):  # refused before anything is written
      raise UserError("--check_logits with a run directory is not supported; check the HF output with to_maxtext instead")
    converter.to_hf(args.maxtext_dir, args.output_dir, args.merge_lora)
    print(f"Wrote {args.output_dir}", flush=True)
    if args.check_logits:
      config, params_dir = converter.load_maxtext_dir(args.maxtext_dir)
      logit_check.check(args.output_dir, model_yml, params_dir, config.vocab_size)


if __name__ == "__main__":
  run_and_exit_on_user_error(main, sys.argv)
