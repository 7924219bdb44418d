"""Numerics of a converted tiny model against transformers' own: the step-0 training loss and greedy decoding, shared
by the families' tests."""

import os

import jax
import numpy as np


def step0_losses(hf_dir: str, maxtext_dir: str, tokens: np.ndarray) -> tuple[float, float]:
  """(train_step's loss without auxiliary terms on the converted params in maxtext_dir, transformers' loss with
  labels of hf_dir's model), on tokens (B, T): T - 1 inputs and their next tokens, in float32."""
  import os  # pylint: disable=import-outside-toplevel

  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  from MaxText.features import selection  # pylint: disable=import-outside-toplevel
  from MaxText.hf_conversion import converter, logit_check  # pylint: disable=import-outside-toplevel
  from MaxText.training import train_step  # pylint: disable=import-outside-toplevel

  model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
  with torch.no_grad():
    ids = torch.from_numpy(np.asarray(tokens)).long()
    expected = float(model(ids, labels=ids).loss)
  length = tokens.shape[1] - 1
  config, ours, params = logit_check.converted_model(
    os.path.join(maxtext_dir, converter.MODEL_YML),
    os.path.join(maxtext_dir, converter.PARAMS_DIR),
    length,
    load_balance_loss_weight=0.0,
  )
  positions = np.broadcast_to(np.arange(length, dtype=np.int32), (tokens.shape[0], length))
  ones = np.ones_like(positions)
  batch = dict(
    inputs=tokens[:, :-1],
    targets=tokens[:, 1:],
    inputs_position=positions,
    inputs_segmentation=ones,
    targets_segmentation=ones,
  )
  with jax.default_matmul_precision("float32"):
    loss, aux = train_step.loss_fn(
      ours, config, selection.for_config(config), params, batch, jax.random.PRNGKey(0), train=True
    )
  return float(loss / aux.weights), expected


def greedy_against_transformers(hf_dir: str, maxtext_dir: str, prompt: list[int], **keys):
  """Greedy decoding of `prompt` on a converted model (decode.py's path: prefill, then a token at a time over the KV
  cache) and transformers' `generate` on hf_dir's model, as many tokens each, past any end token.

  Args:
    hf_dir, maxtext_dir: the HF model and its conversion.
    prompt: token ids.
    **keys: config keys (max_target_length, max_prefill_predict_length) over the converted model.yml's.
  Returns:
    (our tokens (N,), our logits (N, V), transformers' tokens (N,), transformers' logits (N, V)).
  """
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  from MaxText.hf_conversion import converter  # pylint: disable=import-outside-toplevel
  from MaxText.inference import decoding  # pylint: disable=import-outside-toplevel
  from MaxText.runtime import mesh  # pylint: disable=import-outside-toplevel

  config = converter.maxtext_config(
    os.path.join(maxtext_dir, converter.MODEL_YML),
    load_parameters_path=os.path.join(maxtext_dir, converter.PARAMS_DIR),
    dtype="float32",
    weight_dtype="float32",
    per_device_batch_size=1,
    decode_sampling_strategy="greedy",
    **keys,
  )
  device_mesh = mesh.create_device_mesh(config)
  model, abstract = decoding.build(config, device_mesh)
  params = decoding.load_params(config, model, abstract, device_mesh)
  with jax.default_matmul_precision("float32"):
    ours = decoding.generate(config, model, params, device_mesh, prompt, keep_logits=True)
  reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
  reference.generation_config.eos_token_id = None  # ours runs on past an end token (end_ids=())
  with torch.no_grad():
    out = reference.generate(
      torch.tensor([prompt]),
      max_new_tokens=ours.tokens.shape[1],
      do_sample=False,
      pad_token_id=0,
      output_logits=True,
      return_dict_in_generate=True,
    )
  hf_logits = torch.stack(out.logits, axis=1)[0].numpy()  # (N, V)
  return ours.tokens[0], ours.logits[0], out.sequences[0, len(prompt) :].numpy(), hf_logits


def maxtext_params(maxtext_dir: str) -> dict:
  """{keys: np.ndarray} of a converted checkpoint's params."""
  from MaxText.hf_conversion import converter, maxtext_io  # pylint: disable=import-outside-toplevel

  reader = maxtext_io.ParamsReader(os.path.join(maxtext_dir, converter.PARAMS_DIR))
  return {keys: maxtext_io.read(store) for keys, store in reader.params().items()}


def assert_round_trip_is_bitwise(hf_dir: str, maxtext_dir: str, out_dir) -> str:
  """to_hf of maxtext_dir (a conversion of hf_dir) writes hf_dir's tensors bitwise (names, dtypes, values), and
  to_maxtext of that export gives maxtext_dir's params bitwise; returns the export's directory."""
  import torch  # pylint: disable=import-outside-toplevel

  from MaxText.hf_conversion import converter  # pylint: disable=import-outside-toplevel
  from MaxText.tests.tiny_models import hf_tensors  # pylint: disable=import-outside-toplevel

  hf_out = converter.to_hf(maxtext_dir, os.path.join(out_dir, "hf_out"))
  original, back = hf_tensors(hf_dir), hf_tensors(hf_out)
  assert sorted(original) == sorted(back)
  for name, tensor in original.items():
    assert tensor.dtype == back[name].dtype and torch.equal(tensor, back[name]), name
  converter.to_maxtext(hf_out, os.path.join(out_dir, "maxtext_again"))
  first, again = maxtext_params(maxtext_dir), maxtext_params(os.path.join(out_dir, "maxtext_again"))
  assert sorted(first) == sorted(again)
  for keys, value in first.items():
    assert value.dtype == again[keys].dtype and np.array_equal(value, again[keys]), keys
  return hf_out
