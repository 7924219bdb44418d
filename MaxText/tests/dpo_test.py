"""DPO: pairs as rows, step 0 (policy = reference: loss log 2, rewards 0), parity with TRL's DPOTrainer in
transformers (a policy apart from its reference, and the policy a 30-step run exports), and bad input.

A tiny llama (tiny_models.hf_llama) and tokenizer (helpers.build_chat_tokenizer) are built, nothing downloaded.
"""

import json
import os

import numpy as np
import pytest
import torch  # requirements-test.txt
import transformers

from MaxText.checkpoints import checkpointing
from MaxText.errors import ConfigError, UserError
from MaxText.features import selection
from MaxText.input_pipeline.dpo import DpoDecoder
from MaxText.input_pipeline.packing import PackedStream, RandomAccessCursor
from MaxText.tests.helpers import (
  CHATML,
  LORA_MODULES,
  PAIRS,
  build_chat_tokenizer,
  run_python,
  run_train,
  sft_decoder_config,
  tiny_config,
)
from MaxText.tests.tiny_models import hf_llama, nonzero_lora_b

BETA = 0.1


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
  return build_chat_tokenizer(tmp_path_factory.mktemp("tok") / "chatml", CHATML)


def _dpo_config(tokenizer_path, **overrides):
  keys = dict(train_data_columns=["prompt", "chosen", "rejected"], use_chat_template=True, max_target_length=64)
  return sft_decoder_config(tokenizer_path, **{**keys, **overrides})


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


def test_use_dpo_with_use_sft_is_a_config_error():
  with pytest.raises(ConfigError, match="use_sft=true and use_dpo=true are both set: .*; set one$"):
    tiny_config("use_dpo=true", "use_sft=true")


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


def _converted(hf_dir, directory) -> str:
  from MaxText.hf_conversion import converter  # pylint: disable=import-outside-toplevel

  converter.to_maxtext(hf_dir, str(directory))
  return str(directory)


def _ours(tokenizer_dir, policy_dir, reference_dir) -> dict:
  """Our DPO loss and metrics, means over PAIRS, of a policy against a reference (both converted MaxText dirs)."""
  import jax  # pylint: disable=import-outside-toplevel

  from MaxText.hf_conversion import converter, logit_check  # pylint: disable=import-outside-toplevel
  from MaxText.training import train_step  # pylint: disable=import-outside-toplevel

  def converted(directory):
    return logit_check.converted_model(
      os.path.join(directory, converter.MODEL_YML), os.path.join(directory, converter.PARAMS_DIR), 64
    )

  _, _, reference = converted(reference_dir)
  config, model, policy = converted(policy_dir)
  config = config.replace(use_dpo=True, dpo_beta=BETA, dpo_label_smoothing=0.0)
  batch = _rows(DpoDecoder(_dpo_config(tokenizer_dir)), PAIRS, 64)
  with jax.default_matmul_precision("float32"):
    features = selection.for_config(config)
    constants = {"dpo": {"params": reference, "collections": {}}}
    loss, aux = train_step.loss_fn(model, config, features, policy, batch, jax.random.PRNGKey(0), True, None, constants)
  return {"loss": float(loss / aux.weights), **{k: float(v / aux.weights) for k, v in aux.metrics.items()}}


def test_step0_policy_is_the_reference(tokenizer_dir, tmp_path):
  start = _converted(hf_llama(tmp_path / "hf"), tmp_path / "maxtext")
  ours = _ours(tokenizer_dir, start, start)
  assert ours["loss"] == pytest.approx(np.log(2), rel=1e-6)
  for name in ("dpo/chosen_rewards", "dpo/rejected_rewards", "dpo/margin", "dpo/reward_accuracy"):
    assert ours[name] == 0.0, name


# TRL's names for our dpo/* metrics.
TRL_METRICS = {
  "rewards/chosen": "dpo/chosen_rewards",
  "rewards/rejected": "dpo/rejected_rewards",
  "rewards/margins": "dpo/margin",
  "rewards/accuracies": "dpo/reward_accuracy",
}


def _hf_model(directory):
  return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")


def _trl_dpo(policy, reference, tokenizer_dir, tmp_path, peft_adapter=None) -> dict:
  """TRL's DPOTrainer (its tokenization, collator, forward and sigmoid loss) on PAIRS as chat records: the loss and
  the reward metrics of the policy against the reference (transformers models), under our metric names.

  With peft_adapter (a PEFT adapter dir), the policy is the base and reference None: TRL adds a new adapter of that
  config (its reference is then the base, the adapter disabled) and the test loads the adapter's weights into it. A
  PeftModel passed in would instead be its own reference: TRL copies a pretrained adapter as the reference.

  TRL's responses end with the newline that the template writes after <|im_end|>; our rows leave it out (it belongs
  to no turn). Asserted to be the only difference from our rows' tokens, and left out of TRL's batch.
  """
  import datasets  # pylint: disable=import-outside-toplevel
  import peft  # pylint: disable=import-outside-toplevel  # requirements-test.txt
  import safetensors.torch  # pylint: disable=import-outside-toplevel
  import trl  # pylint: disable=import-outside-toplevel  # requirements-test.txt

  records = [
    {
      "prompt": [{"role": "user", "content": pair["prompt"]}],
      "chosen": [{"role": "assistant", "content": pair["chosen"]}],
      "rejected": [{"role": "assistant", "content": pair["rejected"]}],
    }
    for pair in PAIRS
  ]
  args = trl.DPOConfig(  # float32: DPOConfig's default bf16 would run the reference under bfloat16 autocast
    output_dir=str(tmp_path / "trl"),
    beta=BETA,
    loss_type=["sigmoid"],
    bf16=False,
    max_length=None,
    report_to=[],
    use_cpu=True,
  )
  trainer = trl.DPOTrainer(
    model=policy,
    ref_model=reference,
    args=args,
    train_dataset=datasets.Dataset.from_list(records),
    processing_class=transformers.AutoTokenizer.from_pretrained(tokenizer_dir),
    peft_config=None if peft_adapter is None else peft.LoraConfig.from_pretrained(peft_adapter),
  )
  if peft_adapter is not None:
    weights = safetensors.torch.load_file(os.path.join(peft_adapter, "adapter_model.safetensors"))
    assert not peft.set_peft_model_state_dict(trainer.model, weights).unexpected_keys
  ours = _rows(DpoDecoder(_dpo_config(tokenizer_dir)), PAIRS, 64)
  examples = []
  for row, example in enumerate(trainer.train_dataset):
    newline = trainer.processing_class.convert_tokens_to_ids("\u010a")  # byte-level BPE's "\n"
    kept = {"prompt_ids": example["prompt_ids"]}
    for segment, column in ((1, "chosen"), (2, "rejected")):
      ids = example[f"{column}_ids"]
      assert ids[-1] == newline, ids
      kept[f"{column}_ids"] = ids[:-1]
      in_segment = ours["targets_segmentation"][row] == segment
      assert ours["targets"][row][in_segment].tolist() == ids[:-1]
      prompt = ours["inputs"][row][ours["inputs_segmentation"][row] == segment][: len(example["prompt_ids"])]
      assert prompt.tolist() == example["prompt_ids"]
    examples.append(kept)
  with torch.no_grad():
    loss = trainer.compute_loss(trainer.model, trainer.data_collator(examples))
  mode = "train" if trainer.model.training else "eval"
  metrics = trainer._metrics[mode]  # pylint: disable=protected-access  # what TRL logs, before it averages steps
  return {"loss": float(loss), **{ours_name: metrics[name][-1] for name, ours_name in TRL_METRICS.items()}}


def _assert_equal_to_trl(ours: dict, trl: dict):
  for name, value in trl.items():
    print(f"{name}: ours {ours[name]:.7g}, TRL {value:.7g}, relative {abs(ours[name] - value) / max(abs(value), 1e-12):.1e}")
    assert ours[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name


def test_a_policy_apart_from_its_reference_gives_trls_loss_and_rewards(tokenizer_dir, tmp_path):
  """A policy that is the reference with noise added: our loss and dpo/* metrics equal TRL's DPOTrainer's."""
  reference_hf = hf_llama(tmp_path / "reference_hf")
  policy = transformers.AutoModelForCausalLM.from_pretrained(reference_hf, dtype=torch.float32)
  torch.manual_seed(3)  # a noise under which the policy prefers the chosen response for half the pairs
  with torch.no_grad():
    for p in policy.parameters():
      p.add_(0.05 * torch.randn_like(p))
  policy.save_pretrained(str(tmp_path / "policy_hf"))
  ours = _ours(
    tokenizer_dir,
    _converted(str(tmp_path / "policy_hf"), tmp_path / "policy"),
    _converted(reference_hf, tmp_path / "reference"),
  )
  trl = _trl_dpo(_hf_model(str(tmp_path / "policy_hf")), _hf_model(reference_hf), tokenizer_dir, tmp_path)
  assert trl["dpo/reward_accuracy"] == 0.5  # the policy is not the reference
  _assert_equal_to_trl(ours, trl)


@pytest.mark.slow
def test_dpo_run_learns_the_preference_and_matches_trl(tokenizer_dir, tmp_path):
  """30 DPO steps of train.py from a converted llama, evaluating on the pairs every 10: the loss falls and the reward
  accuracy rises above 0.5; then our loss and metrics on the exported policy against the starting model equal TRL's
  DPOTrainer's in transformers, and so does the eval after the last step."""
  hf_dir = hf_llama(tmp_path / "hf")
  start = _converted(hf_dir, tmp_path / "start")
  train, metrics = _train_dpo(tokenizer_dir, tmp_path, "dpo", start, "steps=30", "learning_rate=1e-3", "eval_interval=10")
  assert "eval after step 29: eval_loss=" in train.stdout + train.stderr
  losses = [m["learning/loss"] for m in metrics]
  accuracy = [m["dpo/reward_accuracy"] for m in metrics]
  assert len(losses) == 30 and losses[0] == pytest.approx(np.log(2), rel=1e-5)
  assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses
  assert np.mean(accuracy[-5:]) > 0.5, accuracy

  exported = str(tmp_path / "policy_hf")
  run_dir = str(tmp_path / "runs" / "dpo")
  result = run_python(["MaxText/convert_checkpoint.py", "to_hf", "--maxtext_dir", run_dir, "--output_dir", exported])
  assert result.returncode == 0, result.stderr[-3000:]
  trl = _trl_dpo(_hf_model(exported), _hf_model(hf_dir), tokenizer_dir, tmp_path)
  assert abs(trl["dpo/margin"]) > 1e-3  # the policy moved away from the reference
  _assert_equal_to_trl(_ours(tokenizer_dir, _converted(exported, tmp_path / "policy"), start), trl)
  evals = [m for m in metrics if "eval/loss" in m]
  assert [m["step"] for m in evals] == [9, 19, 29] and all(m["eval/total_weights"] == len(PAIRS) for m in evals)
  assert evals[-1]["eval/dpo/reward_accuracy"] > 0.5
  eval_after_training = {name.removeprefix("eval/"): value for name, value in evals[-1].items()}
  _assert_equal_to_trl(eval_after_training, trl)


@pytest.mark.slow
def test_dpo_with_fp8_starts_at_log_2_and_its_margin_rises(tokenizer_dir, tmp_path):
  """DPO with quantization=fp8, from a fresh init: the reference is the step-0 model with its fp8 scales frozen
  (the reference_state slot), so step 0's loss is log 2; the reward margin rises over 20 steps; the frozen scales
  are not the policy's, which move."""
  train, metrics = run_train(
    tmp_path,
    "dpo_fp8",
    *_dpo_args(tokenizer_dir, _write_pairs(tmp_path / "pairs.jsonl")),
    "quantization=fp8",
    "steps=20",
    "learning_rate=1e-3",
    "per_device_batch_size=4",
    "checkpoint_period=19",
  )
  assert train.returncode == 0, train.stderr[-3000:]
  losses, margins = [m["learning/loss"] for m in metrics], [m["dpo/margin"] for m in metrics]
  assert len(losses) == 20 and losses[0] == pytest.approx(np.log(2), rel=1e-6)
  assert np.mean(margins[-5:]) > np.mean(margins[:5]) + 0.05, margins
  assert np.mean(losses[-5:]) < np.mean(losses[:5]), losses
  tree = checkpointing.tree_metadata(str(tmp_path / "dpo_fp8" / "checkpoints" / "19" / "items"), "the checkpoint")
  assert {"fp8_meta", "reference_params", "reference_state"} <= set(tree)


def _train_dpo(tokenizer_dir, tmp_path, run_name, start, *args):
  """A DPO run of train.py from the converted model `start` on PAIRS x 16, evaluating on PAIRS, in float32 (its
  figures are compared with TRL's in float32); returns (the process, its metrics lines)."""
  from MaxText.hf_conversion import converter  # pylint: disable=import-outside-toplevel

  metrics_file = tmp_path / f"{run_name}.jsonl"
  train = run_python(
    [
      "MaxText/train.py",
      os.path.join(start, converter.MODEL_YML),
      f"run_name={run_name}",
      f"base_output_directory={tmp_path / 'runs'}",
      f"load_parameters_path={os.path.join(start, converter.PARAMS_DIR)}",
      f"metrics_file={metrics_file}",
      "per_device_batch_size=4",
      "enable_tensorboard=false",
      "async_checkpointing=false",
      "dtype=float32",
      *_dpo_args(tokenizer_dir, _write_pairs(tmp_path / "pairs.jsonl")),
      f"hf_eval_files={_write_pairs(tmp_path / 'eval_pairs.jsonl', repeats=1)}",
      *args,
    ]
  )
  assert train.returncode == 0, train.stderr[-3000:]
  with open(metrics_file, encoding="utf-8") as f:
    return train, [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
def test_lora_dpo_run_matches_trl_on_the_peft_export(tokenizer_dir, tmp_path):
  """DPO with LoRA, whose reference is the base (B zeroed): 20 steps of train.py from a converted llama start at
  log 2; the run's eval after its last step equals TRL's DPOTrainer training that adapter (the PEFT export) from the
  HF base, whose reference is the base with the adapter disabled."""
  hf_dir = hf_llama(tmp_path / "hf")
  start = _converted(hf_dir, tmp_path / "start")
  lora = ["enable_lora=true", "lora_rank=4", f"lora_module_path={LORA_MODULES}"]
  _, metrics = _train_dpo(
    tokenizer_dir, tmp_path, "lora_dpo", start, *lora, "steps=20", "learning_rate=1e-2", "eval_interval=20"
  )
  assert metrics[0]["learning/loss"] == pytest.approx(np.log(2), rel=1e-5)  # B starts at zero: the policy is the base
  exported = str(tmp_path / "peft")
  result = run_python(
    [
      "MaxText/convert_checkpoint.py",
      "to_hf",
      "--maxtext_dir",
      str(tmp_path / "runs" / "lora_dpo"),
      "--output_dir",
      exported,
    ]
  )
  assert result.returncode == 0, result.stderr[-3000:]
  trl = _trl_dpo(_hf_model(hf_dir), None, tokenizer_dir, tmp_path, peft_adapter=exported)
  assert trl["dpo/reward_accuracy"] > 0.5 and trl["dpo/margin"] > 1e-3  # the adapters learned the preference
  last_eval = {name.removeprefix("eval/"): value for name, value in metrics[-1].items()}
  _assert_equal_to_trl(last_eval, trl)


def test_pairs_that_are_all_dropped_stop_the_run_with_one_line(tokenizer_dir):
  from MaxText.input_pipeline import sft  # pylint: disable=import-outside-toplevel

  decoder = DpoDecoder(_dpo_config(tokenizer_dir, max_target_length=4))  # no prompt leaves room for a response
  with pytest.raises(UserError, match=r"the last 1,000 train samples were all dropped: none has a loss token left"):
    for _ in range(sft.MAX_DROPPED_IN_A_ROW):
      decoder(PAIRS[0])


@pytest.mark.parametrize("qtype", ["int8", "nf4"])  # integer codes, which grad refused (fp8's it took)
def test_a_qlora_dpo_step_moves_the_adapters_only(qtype):
  """DPO with QLoRA: the reference (the base, B zeroed) holds the quantized codes too, and is not differentiated."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from MaxText.layers import layer_names  # pylint: disable=import-outside-toplevel
  from MaxText.runtime.mesh import create_device_mesh  # pylint: disable=import-outside-toplevel
  from MaxText.tests.helpers import token_batch  # pylint: disable=import-outside-toplevel
  from MaxText.training import train_step, training_setup  # pylint: disable=import-outside-toplevel

  keys = ("use_dpo=true", "enable_lora=true", "lora_rank=4", f"lora_weight_qtype={qtype}", "warmup_steps_fraction=0")
  config = tiny_config(*keys, "learning_rate=1e-2")
  mesh = create_device_mesh(config)
  setup = training_setup.build(config, mesh)
  state = setup.init_state(config, mesh)
  state = state.replace(params=nonzero_lora_b(state.params))  # the policy differs from the reference
  pair = jnp.repeat(jnp.array([1, 2], jnp.int32), 16)[None].repeat(2, axis=0)  # chosen, then rejected, in each row
  new_state, metrics = jax.jit(lambda s, b: train_step.train_step(setup.model, config, setup.features, s, b))(
    state, token_batch(segmentation=pair)
  )
  assert np.isfinite(float(metrics["learning/loss"])) and float(metrics["learning/total_weights"]) == 2
  for (keys, old), new in zip(layer_names.flatten(state.params), jax.tree.leaves(new_state.params)):
    assert (not np.array_equal(np.asarray(old), np.asarray(new))) == (keys[-1] in ("lora_a", "lora_b")), keys
