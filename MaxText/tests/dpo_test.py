"""DPO: pairs as rows, step 0 (policy = reference: loss log 2, rewards 0), parity with TRL's loss on transformers'
log-probs of the exported policy and of the reference, a 30-step run, and bad input.

A tiny llama and tokenizer are built here (nothing is downloaded).
"""

import json
import os

import numpy as np
import pytest
import torch  # requirements-test.txt
import transformers

from MaxText.errors import ConfigError, UserError
from MaxText.input_pipeline.dpo import DpoDecoder
from MaxText.input_pipeline.packing import PackedStream, RandomAccessCursor
from MaxText.tests.helpers import run_python, tiny_config
from MaxText.tests.sft_test import CHATML, _config, _hf_llama, build_chat_tokenizer

# A preference the model can learn: the chosen answers are the right ones.
PAIRS = [
  {"prompt": "what is two plus two", "chosen": "four", "rejected": "the cat sat on the mat"},
  {"prompt": "hello there", "chosen": "how are you", "rejected": "no"},
  {"prompt": "the cat", "chosen": "sat on the mat", "rejected": "ran far"},
  {"prompt": "a dog", "chosen": "ran far", "rejected": "maybe yes"},
]
BETA = 0.1


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
  return build_chat_tokenizer(tmp_path_factory.mktemp("tok") / "chatml", CHATML)


def _dpo_config(tokenizer_path, **overrides):
  keys = dict(train_data_columns=["prompt", "chosen", "rejected"], use_chat_template=True, max_target_length=64)
  return _config(tokenizer_path, **{**keys, **overrides})


def _rows(decoder, records, length):
  stream = PackedStream(RandomAccessCursor([decoder(r) for r in records]), seq_len=length, packing=False)
  rows = []
  while True:
    try:
      rows.append(stream.next_row())
    except StopIteration:
      return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def test_a_row_holds_a_pair_with_the_responses_as_segments_1_and_2(tokenizer_dir):
  decoder = DpoDecoder(_dpo_config(tokenizer_dir))
  batch = _rows(decoder, PAIRS, 64)
  renderer = decoder.renderer()
  for row, pair in enumerate(PAIRS):
    for segment, column in ((1, "chosen"), (2, "rejected")):
      targets = batch["targets"][row][batch["targets_segmentation"][row] == segment]
      assert renderer._tok.decode(targets.tolist(), skip_special_tokens=False).strip() == pair[column] + "<|im_end|>"
      in_segment = batch["inputs_segmentation"][row] == segment
      assert (batch["inputs_position"][row][in_segment] == np.arange(in_segment.sum())).all()


@pytest.mark.parametrize(
  "record, columns, says",
  [
    ({"prompt": "a", "chosen": "b"}, ["prompt", "chosen", "rejected"], "records have no column 'rejected'"),
    ({"chosen": "b", "rejected": "c"}, ["prompt", "chosen", "rejected"], "records have no column 'prompt'"),
  ],
)
def test_bad_input_is_one_line(tokenizer_dir, record, columns, says):
  with pytest.raises(UserError) as e:
    DpoDecoder(_dpo_config(tokenizer_dir, train_data_columns=columns))(record)
  assert says in str(e.value) and "\n" not in str(e.value)


def test_use_dpo_with_explicit_packing_is_a_config_error():
  with pytest.raises(ConfigError, match="use_dpo=true needs packing=false") as e:
    tiny_config("use_dpo=true", "packing=true")
  assert "\n" not in str(e.value)
  assert not tiny_config("use_dpo=true").packing  # use_dpo turns the default packing off


def _write_pairs(path, repeats=16):
  with open(path, "w", encoding="utf-8") as f:
    for _ in range(repeats):
      for pair in PAIRS:
        f.write(json.dumps(pair) + "\n")
  return str(path)


def _dpo_args(tokenizer_dir, data):
  return [
    "use_dpo=true",
    f"dpo_beta={BETA}",
    "train_data_columns=['prompt','chosen','rejected']",
    "use_chat_template=true",
    f"tokenizer_path={tokenizer_dir}",
    "max_target_length=64",
    "dataset_type=hf",
    "hf_path=json",
    f"hf_train_files={data}",
    "enable_data_shuffling=false",
  ]


def _step0(tokenizer_dir, tmp_path, hf_dir):
  """Our DPO loss and metrics at step 0 (policy = reference) on the converted llama, and the config, model, params."""
  import jax  # pylint: disable=import-outside-toplevel

  from MaxText import train_step  # pylint: disable=import-outside-toplevel
  from MaxText.hf_conversion import converter, logit_check  # pylint: disable=import-outside-toplevel

  converter.to_maxtext(hf_dir, str(tmp_path / "maxtext"))
  config, model, params = logit_check.converted_model(
    os.path.join(tmp_path / "maxtext", converter.MODEL_YML), os.path.join(tmp_path / "maxtext", converter.PARAMS_DIR), 64
  )
  config = config.replace(use_dpo=True, dpo_beta=BETA, dpo_label_smoothing=0.0)
  batch = _rows(DpoDecoder(_dpo_config(tokenizer_dir)), PAIRS, 64)
  extras = train_step.StepExtras(reference=params)
  with jax.default_matmul_precision("float32"):
    loss, aux = train_step.loss_fn(model, config, params, batch, jax.random.PRNGKey(0), True, extras)
  return float(loss / aux.weights), {k: float(v / aux.weights) for k, v in aux.metrics.items()}


def test_step0_policy_is_the_reference(tokenizer_dir, tmp_path):
  loss, metrics = _step0(tokenizer_dir, tmp_path, _hf_llama(tmp_path / "hf"))
  assert loss == pytest.approx(np.log(2), rel=1e-6)
  for name in ("dpo/chosen_rewards", "dpo/rejected_rewards", "dpo/margin", "dpo/reward_accuracy"):
    assert metrics[name] == 0.0, name


def _hf_response_logps(model_dir, tokenizer_dir) -> np.ndarray:
  """(pairs, 2) transformers' summed log-probs of each chosen and rejected response, the response being what
  apply_chat_template adds after the prompt's generation prompt, less the newline after the end-of-turn token."""
  tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
  out = np.zeros((len(PAIRS), 2))
  for i, pair in enumerate(PAIRS):
    prompt = [{"role": "user", "content": pair["prompt"]}]
    start = len(tok.apply_chat_template(prompt, add_generation_prompt=True)["input_ids"])
    for j, column in enumerate(("chosen", "rejected")):
      ids = tok.apply_chat_template(prompt + [{"role": "assistant", "content": pair[column]}])["input_ids"]
      ids = ids[: len(ids) - 1]  # the "\n" the template writes after <|im_end|> belongs to no turn
      with torch.no_grad():
        logps = torch.log_softmax(model(torch.tensor(ids)[None]).logits[0].double(), -1)  # (T, V)
      out[i, j] = float(sum(logps[t - 1, ids[t]] for t in range(start, len(ids))))
  return out


def _trl_sigmoid_dpo(policy, reference, beta, label_smoothing=0.0) -> dict:
  """TRL's sigmoid DPO loss (trl 1.16 DPOTrainer._compute_loss, written out: its loss is not a separate function)."""
  logsigmoid = torch.nn.functional.logsigmoid
  policy, reference = torch.tensor(policy), torch.tensor(reference)
  chosen_rewards = beta * (policy[:, 0] - reference[:, 0])
  rejected_rewards = beta * (policy[:, 1] - reference[:, 1])
  delta = chosen_rewards - rejected_rewards
  losses = -logsigmoid(delta) * (1 - label_smoothing) - logsigmoid(-delta) * label_smoothing
  return {
    "loss": float(losses.mean()),
    "dpo/chosen_rewards": float(chosen_rewards.mean()),
    "dpo/rejected_rewards": float(rejected_rewards.mean()),
    "dpo/margin": float(delta.mean()),
    "dpo/reward_accuracy": float((chosen_rewards > rejected_rewards).float().mean()),
  }


@pytest.mark.slow
def test_dpo_run_learns_the_preference_and_matches_trl(tokenizer_dir, tmp_path):
  """30 DPO steps of train.py from a converted llama: the loss falls and the reward accuracy rises above 0.5; then
  our loss and metrics on the exported policy against the starting model equal TRL's on transformers' log-probs."""
  import jax  # pylint: disable=import-outside-toplevel

  from MaxText import train_step  # pylint: disable=import-outside-toplevel
  from MaxText.hf_conversion import converter, logit_check  # pylint: disable=import-outside-toplevel

  hf_dir = _hf_llama(tmp_path / "hf")
  start = str(tmp_path / "start")
  converter.to_maxtext(hf_dir, start)
  metrics_file = tmp_path / "dpo.jsonl"
  data = _write_pairs(tmp_path / "pairs.jsonl")
  train = run_python(
    [
      "MaxText/train.py",
      os.path.join(start, converter.MODEL_YML),
      "run_name=dpo",
      f"base_output_directory={tmp_path / 'runs'}",
      f"load_parameters_path={os.path.join(start, converter.PARAMS_DIR)}",
      f"metrics_file={metrics_file}",
      "steps=30",
      "per_device_batch_size=4",
      "learning_rate=1e-3",
      "enable_tensorboard=false",
      "async_checkpointing=false",
      *_dpo_args(tokenizer_dir, data),
    ]
  )
  assert train.returncode == 0, train.stderr[-3000:]
  with open(metrics_file, encoding="utf-8") as f:
    metrics = [json.loads(line) for line in f if line.strip()]
  losses = [m["learning/loss"] for m in metrics]
  accuracy = [m["dpo/reward_accuracy"] for m in metrics]
  assert len(losses) == 30 and losses[0] == pytest.approx(np.log(2), rel=1e-5)
  assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses
  assert np.mean(accuracy[-5:]) > 0.5, accuracy

  exported = str(tmp_path / "policy_hf")
  run_dir = str(tmp_path / "runs" / "dpo")
  result = run_python(["MaxText/convert_checkpoint.py", "to_hf", "--maxtext_dir", run_dir, "--output_dir", exported])
  assert result.returncode == 0, result.stderr[-3000:]
  expected = _trl_sigmoid_dpo(_hf_response_logps(exported, tokenizer_dir), _hf_response_logps(hf_dir, tokenizer_dir), BETA)
  assert abs(expected["dpo/margin"]) > 1e-3  # the policy moved away from the reference

  policy_dir = str(tmp_path / "policy")
  converter.to_maxtext(exported, policy_dir)
  _, _, reference = logit_check.converted_model(
    os.path.join(start, converter.MODEL_YML), os.path.join(start, converter.PARAMS_DIR), 64
  )
  config, model, policy = logit_check.converted_model(
    os.path.join(policy_dir, converter.MODEL_YML), os.path.join(policy_dir, converter.PARAMS_DIR), 64
  )
  config = config.replace(use_dpo=True, dpo_beta=BETA, dpo_label_smoothing=0.0)
  batch = _rows(DpoDecoder(_dpo_config(tokenizer_dir)), PAIRS, 64)
  with jax.default_matmul_precision("float32"):
    extras = train_step.StepExtras(reference=reference)
    loss, aux = train_step.loss_fn(model, config, policy, batch, jax.random.PRNGKey(0), True, extras)
  ours = {"loss": float(loss / aux.weights), **{k: float(v / aux.weights) for k, v in aux.metrics.items()}}
  for name, value in expected.items():
    print(f"{name}: ours {ours[name]:.7g}, TRL {value:.7g}, relative {abs(ours[name] - value) / max(abs(value), 1e-12):.1e}")
    assert ours[name] == pytest.approx(value, rel=1e-4, abs=1e-7), name


def test_pairs_that_are_all_dropped_stop_the_run_with_one_line(tokenizer_dir):
  from MaxText.input_pipeline import sft  # pylint: disable=import-outside-toplevel

  decoder = DpoDecoder(_dpo_config(tokenizer_dir, max_target_length=4))  # no prompt leaves room for a response
  with pytest.raises(UserError, match=r"the last 1,000 train samples were all dropped: none has a loss token left"):
    for _ in range(sft.MAX_DROPPED_IN_A_ROW):
      decoder(PAIRS[0])
