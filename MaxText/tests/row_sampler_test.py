"""generation/row_sampler.py: a prompt per row, per-row stops at end tokens, the sampled tokens' log-probs (against a
full forward pass without the cache), and one compilation for every call of a run."""

import jax
import numpy as np
import pytest

from MaxText.generation import row_sampler
from MaxText.inference import decoding
from MaxText.runtime import mesh, sharding
from MaxText.tests.helpers import tiny_config
from MaxText.tests.tiny_models import DECODE_KEYS

PROMPT_LENGTHS = np.array([6, 3, 8, 1])
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def run():
  config = tiny_config(
    *DECODE_KEYS,
    "per_device_batch_size=4",
    "dataset_type=synthetic",
    "decode_sampling_strategy=weighted",
    f"decode_sampling_temperature={TEMPERATURE}",
  )
  device_mesh = mesh.create_device_mesh(config)
  model, abstract = decoding.build(config, device_mesh)
  params = decoding.random_params(config, model, abstract, device_mesh)
  prompts = np.random.default_rng(0).integers(3, 4000, (4, config.max_prefill_predict_length))
  prompts = prompts * (np.arange(prompts.shape[1]) < PROMPT_LENGTHS[:, None])
  return config, device_mesh, model, params, prompts.astype(np.int32)


def _full_forward_logps(config, device_mesh, model, params, prompts, completions) -> np.ndarray:
  """(B, N) log-probs of each row's completion from one forward pass over its prompt + completion, without the cache
  (rows right-padded: padding has segment 0)."""
  rows, budget = completions.shape
  sequences = np.zeros((rows, prompts.shape[1] + budget), np.int32)
  for row, length in enumerate(PROMPT_LENGTHS):
    sequences[row, : length + budget] = np.concatenate([prompts[row, :length], completions[row]])
  positions = np.broadcast_to(np.arange(sequences.shape[1]), sequences.shape)
  segments = (positions < (PROMPT_LENGTHS + budget)[:, None]).astype(np.int32)
  with sharding.logical_context(device_mesh, config):
    logits = jax.jit(model.apply)({"params": params}, sequences, positions, segments)
  logps = np.asarray(jax.nn.log_softmax(np.asarray(logits, np.float64) / TEMPERATURE, axis=-1))
  at = (PROMPT_LENGTHS - 1)[:, None] + np.arange(budget)  # position t's logits sampled token t + 1
  return np.take_along_axis(np.take_along_axis(logps, at[:, :, None], axis=1), completions[:, :, None], axis=-1)[..., 0]


def test_each_row_samples_after_its_own_prompt_with_the_log_probs_of_a_full_forward(run):
  config, device_mesh, model, params, prompts = run
  sampler = row_sampler.RowSampler(config, model, device_mesh)
  samples = sampler.sample(params, prompts, PROMPT_LENGTHS, jax.random.PRNGKey(3))
  assert samples.tokens.shape == samples.logps.shape == (4, 16) and (samples.lengths == 16).all()
  expected = _full_forward_logps(config, device_mesh, model, params, prompts, samples.tokens)
  np.testing.assert_allclose(samples.logps, expected, atol=1e-5)
  assert len({tuple(t) for t in samples.tokens}) == 4  # rows differ (their prompts and draws do)


def test_rows_stop_at_their_first_end_token_and_the_functions_compile_once(run):
  config, device_mesh, model, params, prompts = run
  rng = jax.random.PRNGKey(3)
  free = row_sampler.RowSampler(config, model, device_mesh).sample(params, prompts, PROMPT_LENGTHS, rng)
  end = int(free.tokens[1, 4])  # row 1 ends at its 5th token; the others where (if) they draw it
  sampler = row_sampler.RowSampler(config, model, device_mesh, end_ids=(end,))
  stopped = sampler.sample(params, prompts, PROMPT_LENGTHS, rng)
  for row in range(4):
    tokens = list(free.tokens[row])
    length = tokens.index(end) + 1 if end in tokens else 16
    assert stopped.lengths[row] == length
    np.testing.assert_array_equal(stopped.tokens[row, :length], free.tokens[row, :length])  # the same draws
    assert not stopped.tokens[row, length:].any() and not stopped.logps[row, length:].any()
  assert stopped.lengths[1] == 5
  compiled = (sampler.prefill, sampler.step)
  again = sampler.sample(params, prompts[::-1], PROMPT_LENGTHS[::-1], jax.random.PRNGKey(4))  # new prompts, new draws
  assert (sampler.prefill, sampler.step) == compiled  # compiled at the first call only
  assert not np.array_equal(again.tokens, stopped.tokens)
