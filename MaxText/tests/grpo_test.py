"""GRPO's objective: parity with TRL's GRPOTrainer loss computation (loss, KL, clip fraction) on fixed prompts,
completions, rewards, policy, reference and old policy; sequence-mean against a NumPy reference; step 0 (policy =
reference: KL 0; equal rewards: no gradient); and the config's one-line errors.

The three models are tiny transformers llamas (tiny_models.hf_llama, noise added), converted to MaxText; nothing is
downloaded.
"""

import numpy as np
import pytest
import torch  # requirements-test.txt
import transformers

from MaxText.errors import ConfigError
from MaxText.features import grpo, selection
from MaxText.tests.helpers import CHATML, build_chat_tokenizer, tiny_config
from MaxText.tests.tiny_models import hf_llama

GENERATIONS = 4
PROMPT_LENGTH, COMPLETION_LENGTH = 6, 10
COMPLETION_LENGTHS = [10, 7, 3, 10, 1, 9, 5, 10]  # two prompts' groups of 4
REWARDS = [1.0, 0.0, 0.5, 1.0, 0.0, 0.25, 1.0, 0.0]
TEMPERATURE = 0.9
BETA = 0.04


def _noisy(source_dir, target_dir, scale, seed) -> str:
  model = transformers.AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32)
  torch.manual_seed(seed)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(scale * torch.randn_like(p))
  model.save_pretrained(str(target_dir))
  return str(target_dir)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """HF dirs and converted MaxText dirs of the reference, the policy (the reference with noise) and the old policy
  (the policy with noise, far enough apart that some ratios leave [0.8, 1.2])."""
  from MaxText.hf_conversion import converter  # pylint: disable=import-outside-toplevel

  root = tmp_path_factory.mktemp("grpo")
  hf = {"reference": hf_llama(root / "reference_hf")}
  hf["policy"] = _noisy(hf["reference"], root / "policy_hf", 0.05, 3)
  hf["old"] = _noisy(hf["policy"], root / "old_hf", 0.05, 4)
  converted = {}
  for name, directory in hf.items():
    converter.to_maxtext(directory, str(root / name))
    converted[name] = str(root / name)
  return {"hf": hf, "maxtext": converted, "tokenizer": build_chat_tokenizer(root / "tok", CHATML)}


def _sequences():
  """Prompts (B, P) and right-padded completions (B, C) of random ids, and the completions' mask (B, C)."""
  rng = np.random.default_rng(0)
  prompts = rng.integers(10, 300, (len(REWARDS) // GENERATIONS, PROMPT_LENGTH)).repeat(GENERATIONS, axis=0)
  completions = rng.integers(10, 300, (len(REWARDS), COMPLETION_LENGTH))
  mask = (np.arange(COMPLETION_LENGTH) < np.array(COMPLETION_LENGTHS)[:, None]).astype(np.int32)
  return prompts, completions * mask, mask


def _rows(prompts, completions, mask) -> dict:
  """Our train rows: prompt + completion, the completion's targets with targets_segmentation 1."""
  tokens = np.concatenate([prompts, completions], axis=1)
  real = np.concatenate([np.ones_like(prompts), mask], axis=1)
  length = tokens.shape[1] - 1
  targets_segmentation = real[:, 1:] * (np.arange(length) >= PROMPT_LENGTH - 1)
  return {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "inputs_position": np.broadcast_to(np.arange(length), (len(tokens), length)).copy(),
    "inputs_segmentation": real[:, :-1],
    "targets_segmentation": targets_segmentation.astype(np.int32),
  }


def _ours(models, settings: dict, old: bool) -> dict:
  """Our loss, rl/kl and rl/clip_fraction through train_step.loss_fn, as a run computes them."""
  import os  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel

  from MaxText.hf_conversion import converter, logit_check  # pylint: disable=import-outside-toplevel
  from MaxText.training import step_metrics, train_step  # pylint: disable=import-outside-toplevel

  def converted(name):
    directory = models["maxtext"][name]
    return logit_check.converted_model(
      os.path.join(directory, converter.MODEL_YML), os.path.join(directory, converter.PARAMS_DIR), 16
    )

  _, _, reference = converted("reference")
  config, model, policy = converted("policy")
  config = config.replace(use_grpo=True, decode_sampling_temperature=TEMPERATURE, **settings)
  batch = _rows(*_sequences())
  batch[grpo.ADVANTAGES] = grpo.group_advantages(REWARDS, GENERATIONS)
  with jax.default_matmul_precision("float32"):
    if old:
      _, _, old_params = converted("old")
      logits = model.apply({"params": old_params}, batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
      batch[grpo.OLD_LOGPS] = grpo.token_logps(logits, batch["targets"], TEMPERATURE)
    features = selection.for_config(config)
    constants = {"grpo": {"params": reference, "collections": {}} if config.grpo_beta > 0 else None}
    loss, aux = train_step.loss_fn(model, config, features, policy, batch, jax.random.PRNGKey(0), True, None, constants)
  ours = {"loss": float(loss / aux.weights)}
  return ours | {name: float(step_metrics.own_mean(value)) for name, value in aux.metrics.items()}


def _trl(models, tmp_path, trl_args: dict, old: bool) -> dict:
  """TRL's GRPOTrainer._compute_loss on the same sequences, its log-probs from its fused LM head (temperature), the
  reference's and the old policy's from its own _get_per_token_logps_and_entropies; the advantages as its
  _generate_and_score_completions makes them (group mean, nanstd with Bessel's correction, + 1e-4)."""
  import datasets  # pylint: disable=import-outside-toplevel
  import trl  # pylint: disable=import-outside-toplevel  # requirements-test.txt
  from trl.trainer.utils import add_fused_lm_head, nanstd  # pylint: disable=import-outside-toplevel

  def hf_model(name):
    return transformers.AutoModelForCausalLM.from_pretrained(models["hf"][name], dtype=torch.float32)

  args = trl.GRPOConfig(
    output_dir=str(tmp_path / "trl"),
    num_generations=GENERATIONS,
    per_device_train_batch_size=len(REWARDS),
    temperature=TEMPERATURE,
    bf16=False,
    report_to=[],
    use_cpu=True,
    use_bias_correction_kl=False,  # the k3 KL as GRPO's paper and upstream MaxText have it, not times the ratio
    **trl_args,
  )
  trainer = trl.GRPOTrainer(
    model=hf_model("policy"),
    reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
    args=args,
    train_dataset=datasets.Dataset.from_list([{"prompt": "a"}] * len(REWARDS)),
    processing_class=transformers.AutoTokenizer.from_pretrained(models["tokenizer"]),
  )
  prompts, completions, mask = (torch.tensor(x) for x in _sequences())
  inputs = {"prompt_ids": prompts, "prompt_mask": torch.ones_like(prompts), "completion_ids": completions}
  inputs |= {"completion_mask": mask, "num_items_in_batch": mask.sum()}
  rewards = torch.tensor(REWARDS)
  mean = rewards.view(-1, GENERATIONS).mean(dim=1).repeat_interleave(GENERATIONS)
  std = nanstd(rewards.view(-1, GENERATIONS), dim=1).repeat_interleave(GENERATIONS)
  inputs["advantages"] = (rewards - mean) / (std + 1e-4)
  sequence = torch.cat([prompts, completions], dim=1)
  attention = torch.cat([inputs["prompt_mask"], mask], dim=1)

  def logps(model):
    return trainer._get_per_token_logps_and_entropies(model, sequence, attention, COMPLETION_LENGTH)[0]  # pylint: disable=protected-access

  with torch.no_grad():
    if trainer.beta != 0.0:
      trainer.ref_model.load_state_dict(hf_model("reference").state_dict())
      inputs["ref_per_token_logps"] = logps(trainer.ref_model)
    if old:
      old_model = hf_model("old")
      add_fused_lm_head(old_model, temperature=TEMPERATURE)
      inputs["old_per_token_logps"] = logps(old_model)
    loss = trainer._compute_loss(trainer.model, inputs)  # pylint: disable=protected-access
  metrics = trainer._metrics["train" if trainer.model.training else "eval"]  # pylint: disable=protected-access
  out = {"loss": float(loss), "rl/clip_fraction": metrics["clip_ratio/region_mean"][-1]}
  return out | ({"rl/kl": metrics["kl"][-1]} if trainer.beta != 0.0 else {})


# (our keys, TRL's GRPOConfig keys): loss_agg_mode and loss_algo against loss_type and importance_sampling_level.
CASES = {
  "sequence-mean-token-mean": (
    dict(loss_agg_mode="sequence-mean-token-mean", loss_algo="grpo"),
    dict(loss_type="grpo", importance_sampling_level="token"),
  ),
  "token-mean": (dict(loss_agg_mode="token-mean", loss_algo="grpo"), dict(loss_type="dapo")),
  "gspo-token": (
    dict(loss_agg_mode="sequence-mean-token-mean", loss_algo="gspo-token"),
    dict(loss_type="grpo", importance_sampling_level="sequence"),
  ),
}
CLIPS = {"symmetric": (0.2, 0.2), "epsilon_high": (0.2, 0.28)}


def _compare(models, tmp_path, case: str, iterations: int, clip: str, beta: float = BETA):
  ours_keys, trl_keys = CASES[case]
  epsilon, epsilon_high = CLIPS[clip]
  ours_keys = dict(ours_keys, grpo_epsilon=epsilon, epsilon_high=epsilon_high, grpo_beta=beta, num_iterations=iterations)
  trl_keys = dict(trl_keys, epsilon=epsilon, epsilon_high=epsilon_high, beta=beta, num_iterations=iterations)
  ours = _ours(models, ours_keys, old=iterations > 1)
  theirs = _trl(models, tmp_path, trl_keys, old=iterations > 1)
  for name, value in theirs.items():
    print(f"{case} x{iterations} {clip} {name}: ours {ours[name]:.8g}, TRL {value:.8g}, diff {abs(ours[name] - value):.1e}")
    assert ours[name] == pytest.approx(value, abs=1e-5), name
  assert set(ours) == set(theirs)
  return ours


@pytest.mark.parametrize("case", list(CASES))
def test_the_loss_kl_and_clip_fraction_equal_trls_with_old_logps_and_epsilon_high(models, tmp_path, case):
  """num_iterations=2 (the old policy's log-probs make the ratio) with epsilon_high above grpo_epsilon: the clipping
  acts (some ratios leave the range), and the figures equal TRL's within 1e-5."""
  ours = _compare(models, tmp_path, case, 2, "epsilon_high")
  assert ours["rl/clip_fraction"] > 0 and ours["rl/kl"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("iterations, clip", [(1, "symmetric"), (1, "epsilon_high"), (2, "symmetric")])
def test_every_mode_equals_trl(models, tmp_path, case, iterations, clip):
  _compare(models, tmp_path, case, iterations, clip)


def test_without_a_reference_the_loss_equals_trls_and_no_kl_is_logged(models, tmp_path):
  """grpo_beta=0: TRL keeps no reference model, we keep no reference slot (the config makes none), only the loop's."""
  ours = _compare(models, tmp_path, "sequence-mean-token-mean", 2, "symmetric", beta=0.0)
  assert "rl/kl" not in ours
  slots = grpo.Grpo(_grpo_config(grpo_beta=0.0), others=()).slots({"params": {"w": np.zeros(2)}})
  assert set(slots) == {grpo.ROLLOUTS, grpo.RNG}  # the rollouts and the sampling key; no reference


def _numpy_sequence_mean(logps, old_logps, ref_logps, advantages, mask, epsilon, epsilon_high, beta) -> float:
  """sequence-mean in float64: the mean over sequences of each one's summed per-token loss."""
  ratio = np.exp(logps - old_logps)
  a = advantages[:, None]
  per_token = -np.minimum(ratio * a, np.clip(ratio, 1 - epsilon, 1 + epsilon_high) * a)
  per_token += beta * (np.exp(ref_logps - logps) - (ref_logps - logps) - 1)
  sums = (per_token * mask).sum(axis=1)
  return float(sums[mask.sum(axis=1) > 0].mean())


def test_sequence_mean_equals_a_numpy_reference():
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(1)
  logps, old, ref = (rng.normal(-2.0, 0.3, (6, 9)) for _ in range(3))
  mask = (np.arange(9) < np.array([9, 4, 1, 0, 7, 9])[:, None]).astype(np.float64)  # row 3: no completion
  advantages = grpo.group_advantages([1, 0, 0.5, 0.5, 0.2, 0.9], 3)
  settings = grpo.Settings("grpo", "sequence-mean", 0.2, 0.28, 0.1, 1.0)
  total, weights, _ = grpo.loss(*(jnp.asarray(x, jnp.float32) for x in (logps, old, ref, advantages, mask)), settings)
  assert float(weights) == 5
  expected = _numpy_sequence_mean(logps, old, ref, advantages, mask, 0.2, 0.28, 0.1)
  assert float(total / weights) == pytest.approx(expected, rel=1e-5)


def test_group_advantages_standardize_each_group_with_bessels_std():
  rewards = [1.0, 0.0, 0.5, 0.3, 0.3, 0.3]
  advantages = grpo.group_advantages(rewards, 3)
  first = np.array(rewards[:3])
  np.testing.assert_allclose(advantages[:3], (first - first.mean()) / (first.std(ddof=1) + 1e-4), rtol=1e-6)
  assert (advantages[3:] == 0).all()  # equal rewards in a group: no advantage


def test_step_0_the_kl_is_0_and_equal_rewards_give_no_gradient():
  """The policy is the reference (step 0): the KL is 0. A group of equal rewards: advantages 0, and with the policy at
  the reference the loss and its gradient are 0 (the KL's gradient is 0 there too)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(2)
  logps = jnp.asarray(rng.normal(-2.0, 0.3, (4, 5)), jnp.float32)
  mask = jnp.ones((4, 5), jnp.float32)
  settings = grpo.Settings("grpo", "token-mean", 0.2, 0.2, 0.04, 1.0)
  advantages = jnp.asarray(grpo.group_advantages([0.7] * 4, 4))

  def total(x):
    return grpo.loss(x, x, logps, advantages, mask, settings)[0]

  _, _, metrics = grpo.loss(logps, logps, logps, advantages, mask, settings)
  assert float(metrics["rl/kl"][0]) == 0.0
  assert float(total(logps)) == 0.0
  assert not np.asarray(jax.grad(total)(logps)).any()


def _grpo_config(*args, **kwargs):
  keys = (
    "use_grpo=true",
    "dataset_type=hf",
    "hf_path=json",
    "hf_train_files=prompts.jsonl",
    "train_data_columns=['prompt','answer']",
    "max_prefill_predict_length=16",
    "reward_functions_path=rewards.py",
    "reward_functions=exact",
    "per_device_batch_size=4",
  )
  return tiny_config(*keys, *args, **kwargs)


@pytest.mark.parametrize(
  "args, says",
  [
    (["num_generations=1"], "num_generations=1 must be an integer >= 2 (GRPO compares the completions of a group)"),
    (["num_generations=3"], "the batch of 4 rows (per_device_batch_size x devices x gradient_accumulation_steps) must"),
    (["packing=true"], "use_grpo=true needs packing=false (each row holds one prompt and its completion)"),
    (["use_dpo=true"], "use_grpo=true and use_dpo=true are both set"),
    (["grpo_epsilon=0.3", "epsilon_high=0.2"], "epsilon_high=0.2 must be >= grpo_epsilon=0.3"),
    (["reward_functions="], "use_grpo=true needs reward_functions_path (a Python file) and reward_functions"),
    (["reward_weights=[1.0,2.0]"], "reward_weights=[1.0, 2.0] has 2 weights for 1 reward functions (exact)"),
    (["train_data_columns=['question']"], "use_grpo=true reads train_data_columns=['prompt', ...]"),
    (["max_prefill_predict_length=32"], "max_prefill_predict_length=32 must be below max_target_length=32"),
    (["loss_agg_mode=token-sum"], "loss_agg_mode=token-sum is not valid"),
    (["eval_interval=5", "hf_eval_files=p.jsonl"], "use_grpo=true has no eval loss: set eval_interval=-1"),
  ],
)
def test_bad_keys_are_one_line(args, says):
  with pytest.raises(ConfigError) as e:
    _grpo_config(*args)
  assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_keys_nest_under_rl_as_upstreams_and_packing_and_epsilon_high_follow():
  config = _grpo_config("rl.num_generations=2", "rl.grpo_beta=0")
  assert (config.num_generations, config.grpo_beta, config.packing) == (2, 0.0, False)
  assert config.epsilon_high == config.grpo_epsilon == 0.2
  assert [f.name for f in selection.for_config(config)] == ["grpo"]


@pytest.mark.slow  # about 30 s: two train steps compiled per mode
@pytest.mark.parametrize("agg_mode", ["sequence-mean-token-mean", "token-mean"])
def test_a_step_with_gradient_accumulation_is_the_large_batchs(agg_mode):
  """train_step on a GRPO batch (advantages, old log-probs) in 2 microbatches: the loss, rl/kl, rl/clip_fraction and
  the update equal those of one microbatch (the metrics' (sum, count) pairs add over microbatches)."""
  import jax  # pylint: disable=import-outside-toplevel

  from MaxText.runtime.mesh import create_device_mesh  # pylint: disable=import-outside-toplevel
  from MaxText.tests.helpers import token_batch  # pylint: disable=import-outside-toplevel
  from MaxText.training import train_step, training_setup  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(5)
  completion = (np.arange(32) >= 20) & (np.arange(32) < 20 + rng.integers(1, 12, (8, 1)))
  batch = token_batch(rows=8) | {"targets_segmentation": completion.astype(np.int32)}
  batch[grpo.ADVANTAGES] = grpo.group_advantages(rng.random(8), 4)
  batch[grpo.OLD_LOGPS] = rng.normal(-8.3, 0.3, (8, 32)).astype(np.float32)  # some ratios leave the clip range
  results = []
  for steps in (1, 2):
    config = _grpo_config(
      f"gradient_accumulation_steps={steps}", f"per_device_batch_size={8 // steps}", f"loss_agg_mode={agg_mode}"
    )
    mesh = create_device_mesh(config)
    setup = training_setup.build(config, mesh)
    state = setup.features[0].on_start(setup.init_state(config, mesh))
    step = jax.jit(lambda s, b, setup=setup, config=config: train_step.train_step(setup.model, config, setup.features, s, b))
    results.append(step(state, batch))
  (one, metrics_one), (two, metrics_two) = results
  for name in ("learning/loss", "rl/kl", "rl/clip_fraction"):
    assert float(metrics_two[name]) == pytest.approx(float(metrics_one[name]), rel=1e-5), name
  assert 0 < float(metrics_one["rl/clip_fraction"]) < 1
  for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(two.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
