"""Generates text from a checkpoint:

    python3 MaxText/decode.py MaxText/configs/base.yml run_name=x load_parameters_path=<run>/checkpoints/<N>/items \\
        prompt="I love to" [decode_sampling_strategy=greedy|weighted|nucleus|topk] [model keys of the run...]

The params come from load_parameters_path, load_full_state_path, or else the latest checkpoint of the run
run_name under base_output_directory (random, with a warning, if there is none). The prompt is prefilled into
the model's KV cache, then max_target_length - max_prefill_predict_length tokens are sampled for each of the
per_device_batch_size x devices rows, which stop at the tokenizer's end token. Prints one line per row,
Input `<prompt>` -> `<completion>`, then the prefill time, the time per generated token and the tokens/s.

With use_multimodal (Gemma 3), image_path's images (','-separated files) take the places of the prompt's
image_placeholder (<|image|>), one each, in order.
"""

import os
import sys

if __package__ in (None, ""):  # Run as `python3 MaxText/decode.py`: import MaxText from this checkout.
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from MaxText import pyconfig  # pylint: disable=wrong-import-position
from MaxText.configuration import config_loader
from MaxText.errors import UserError  # pylint: disable=wrong-import-position
from MaxText.input_pipeline import images, tokenizer_assets
from MaxText.runtime.entry_point import run_and_exit_on_user_error  # pylint: disable=wrong-import-position


def _check_config(config) -> None:
  if not config.prompt:
    raise UserError('prompt is empty: give the text to continue, e.g. prompt="I love to"')
  if config.max_target_length <= config.max_prefill_predict_length:
    raise UserError(
      f"max_target_length={config.max_target_length} must exceed max_prefill_predict_length="
      f"{config.max_prefill_predict_length}: the difference is the number of tokens generated"
    )


def _tokenizer(config):
  from MaxText.input_pipeline.tokenizer import build_tokenizer  # pylint: disable=import-outside-toplevel

  path = pyconfig.resolve_asset_path(config.tokenizer_path, config.config_path)
  path = path or tokenizer_assets.from_package(config.tokenizer_path)
  if not path:
    raise UserError(tokenizer_assets.missing(config.tokenizer_path, config_loader.PACKAGE_DIR))
  tokenizer = build_tokenizer(path, add_bos=config.add_bos, add_eos=False)
  if tokenizer.vocab_size > config.vocab_size:
    raise UserError(
      f"tokenizer_path={config.tokenizer_path} has {tokenizer.vocab_size} tokens but vocab_size={config.vocab_size}: "
      "use the tokenizer the model was trained with"
    )
  return tokenizer


def _prompt_and_images(config, tokenizer):
  """The prompt with image_path's images in place of its placeholders (their soft tokens), and the images' pixels
  (N, C, H, W); the prompt as it is and None without use_multimodal or image_path."""
  if not (config.use_multimodal and config.image_path):
    return config.prompt, None
  images.check_image_token(tokenizer, config)
  paths = [p.strip() for p in config.image_path.split(",") if p.strip()]
  prompt, pixels = images.record_images(config.prompt, paths, config, f"image_path={config.image_path}")
  return prompt, pixels[: len(paths)]


def _prompt_ids(config, tokenizer, prompt: str | None = None) -> tuple[list[int], list[int]]:
  """The prompt's tokens, and the end tokens besides the tokenizer's. With use_chat_template the prompt is a user
  turn and the generation prompt (the template adds BOS), and the completion also ends at the template's end of turn
  (<|im_end|> is no EOS in a ChatML tokenizer). prompt: default config.prompt."""
  prompt = config.prompt if prompt is None else prompt
  if not config.use_chat_template:
    return tokenizer.encode(prompt), []
  from MaxText.input_pipeline.chat_template import ChatRenderer  # pylint: disable=import-outside-toplevel

  path = pyconfig.resolve_asset_path(config.tokenizer_path, config.config_path) or config.tokenizer_path
  renderer = ChatRenderer(path, config.chat_template)
  return renderer.encode_prompt(prompt), renderer.end_of_turn_ids()


def main(argv: list[str]) -> list[str]:
  """Decodes as the config says; returns the completion of each row."""
  config = pyconfig.initialize(argv, reads_data=False)
  _check_config(config)
  tokenizer = _tokenizer(config)
  prompt, pixels = _prompt_and_images(config, tokenizer)
  prompt_ids, end_of_turn = _prompt_ids(config, tokenizer, prompt)
  # pylint: disable=import-outside-toplevel
  from MaxText import max_logging
  from MaxText.generation import prefill_decode
  from MaxText.inference import decoding
  from MaxText.runtime import jax_runtime
  from MaxText.runtime.mesh import create_device_mesh

  prefill_decode.check_prompt(config, prompt_ids)
  max_logging.configure(config.log_all_processes)
  jax_runtime.enable_compilation_cache(config.jax_cache_dir)
  mesh = create_device_mesh(config)
  model, abstract_params = decoding.build(config, mesh)
  params = decoding.load_params(config, model, abstract_params, mesh)
  if config.save_quantized_params_path:
    from MaxText.checkpoints import serving_checkpoint  # pylint: disable=import-outside-toplevel

    serving_checkpoint.save(config, params, config.save_quantized_params_path)
  end_ids = tuple(sorted({*prefill_decode.end_token_ids(tokenizer), *end_of_turn}))
  result = decoding.generate(
    config, model, params, mesh, prompt_ids, end_ids, valid_vocab=tokenizer.vocab_size, images=pixels
  )
  completions = [tokenizer.decode(prefill_decode.completion(row, end_ids)) for row in result.tokens]
  for text in completions:
    max_logging.log(f"Input `{config.prompt}` -> `{text}`")  # process 0 (every process computed them)
  rows, steps = result.tokens.shape[0], result.tokens.shape[1] - 1
  max_logging.log(
    f"Prefill: {result.prefill_s * 1e3:.1f} ms ({len(prompt_ids)} prompt tokens, {rows} rows); "
    f"{result.step_s * 1e3:.2f} ms per generated token ({steps} steps); {result.generated_per_s:.1f} generated tokens/s"
  )
  if config.autoregressive_decode_assert and completions[0] != config.autoregressive_decode_assert:
    raise UserError(
      f"generated text mismatch: `{completions[0]}` is not "
      f"autoregressive_decode_assert=`{config.autoregressive_decode_assert}`"
    )
  return completions


if __name__ == "__main__":
  run_and_exit_on_user_error(main, sys.argv)
