"""z_loss_multiplier: the logged term and the loss against numpy float64 on the logits of the same forward pass, with
padding that the term must not count, alone and with gradient accumulation; off at 0."""

import jax
import numpy as np
import pytest

from MaxText.features import selection, z_loss
from MaxText.tests.helpers import LORA, tiny_config
from MaxText.tests.tiny_models import padded_token_batch, run_train_steps
from MaxText.training import training_setup

MULTIPLIER = 0.3  # large, so that the term is a visible part of the loss


def _reference(config, params) -> tuple[float, float]:
  """(mean cross-entropy, mean z-loss term) over padded_token_batch's counted tokens, in numpy float64."""
  batch = jax.device_get(padded_token_batch())
  model = training_setup.create_model(config)  # LoRA's adapters start with B = 0: the base model's logits
  logits = model.apply({"params": params}, batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
  logits = np.asarray(logits, np.float64)  # (B, T, V)
  peak = logits.max(axis=-1, keepdims=True)
  log_z = np.log(np.exp(logits - peak).sum(axis=-1)) + peak[..., 0]  # (B, T)
  target_logit = np.take_along_axis(logits, np.asarray(batch["targets"])[..., None], axis=-1)[..., 0]
  counted = np.asarray(batch["targets_segmentation"]) != 0
  tokens = counted.sum()
  return ((log_z - target_logit) * counted).sum() / tokens, MULTIPLIER * (log_z**2 * counted).sum() / tokens


@pytest.mark.parametrize("accumulation,lora", [(1, False), (2, False), (1, True)])
def test_logged_term_and_loss_equal_numpy_float64(accumulation, lora):
  rows = f"per_device_batch_size={2 // accumulation}"  # the batch of 2 rows, the padded one a microbatch of its own
  args = (f"z_loss_multiplier={MULTIPLIER}", f"gradient_accumulation_steps={accumulation}", rows, *(LORA if lora else ()))
  config = tiny_config(*args)
  params, metrics = run_train_steps(config, 1)
  xent, term = _reference(config, params)
  assert term > 0.05 * xent  # the term matters in the loss it joins
  np.testing.assert_allclose(metrics[0]["learning/z_loss"], term, rtol=2e-5)
  np.testing.assert_allclose(metrics[0]["learning/loss"], xent + term, rtol=2e-5)


def test_summed_over_counted_tokens_only():
  logits = np.random.default_rng(0).normal(size=(2, 3, 5)).astype(np.float32)
  segments = np.array([[1, 1, 0], [2, 0, 0]])
  total, tokens = z_loss.summed_z_loss(logits, segments)
  log_z = np.log(np.exp(logits.astype(np.float64)).sum(-1))
  np.testing.assert_allclose(total, (log_z**2 * (segments != 0)).sum(), rtol=1e-6)
  assert tokens == 3


def test_chosen_only_when_the_multiplier_is_positive():
  names = lambda config: [f.name for f in selection.for_config(config)]  # noqa: E731
  assert z_loss.NAME in names(tiny_config("z_loss_multiplier=1e-4"))
  assert z_loss.NAME not in names(tiny_config())
