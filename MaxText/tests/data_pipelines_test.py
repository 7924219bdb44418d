"""tfds (TFRecord and ArrayRecord), grain and hf pipelines on small local datasets built by the tests."""

import base64
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from MaxText.input_pipeline import input_pipeline_interface, sample_datasets
from MaxText.input_pipeline.tokenizer import build_tokenizer
from MaxText.runtime import mesh
from MaxText.tests.helpers import (
  REPO_ROOT,
  TRAIN_PY,
  cpu_env,
  finish_processes,
  read_metrics,
  run_python,
  run_train,
  start_cpu_processes,
  tiny_args,
  tiny_config,
)

LIMIT = 300  # documents per split: enough for the tests, quick to prepare


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  root = tmp_path_factory.mktemp("data")
  flags = sample_datasets.write_all(str(root), limit=LIMIT)
  return root, {kind: value.split() for kind, value in flags.items()}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory, data):
  """{kind: tokenizer path}: the shipped SentencePiece model, a byte-level tiktoken file, a trained tokenizer.json."""
  root = tmp_path_factory.mktemp("tokenizers")
  tiktoken_path = root / "bytes.tiktoken"
  tiktoken_path.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel

  hf = Tokenizer(models.BPE())
  hf.pre_tokenizer = pre_tokenizers.ByteLevel()
  hf.decoder = decoders.ByteLevel()
  hf.train_from_iterator(
    sample_datasets.split_texts("train", LIMIT), trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>"])
  )
  hf_path = root / "tokenizer.json"
  hf.save(str(hf_path))
  return {"sentencepiece": tiny_config().tokenizer_path, "tiktoken": str(tiktoken_path), "huggingface": str(hf_path)}


KINDS = ["tfds (TFRecord)", "tfds (ArrayRecord)", "grain (TFDS files)", "grain", "hf (Parquet)"]


@pytest.mark.parametrize("kind", KINDS)
def test_each_dataset_type_trains(tmp_path, data, kind):
  _, flags = data
  extra = ["eval_interval=2", "eval_steps=2"] if kind in ("grain", "hf (Parquet)", "tfds (TFRecord)") else []
  result, metrics = run_train(tmp_path, "data", "steps=3", *flags[kind], *extra)
  assert result.returncode == 0, result.stderr[-3000:]
  assert len(metrics) == 3 and all(m["learning/total_weights"] == 64 for m in metrics)
  if extra:
    assert "eval after step 1: eval_loss=" in result.stdout


def test_grain_reads_the_array_record_files_tfds_wrote_in_the_same_order(tmp_path, data):
  _, flags = data
  _, tfds_metrics = run_train(tmp_path, "tfds", "steps=3", *flags["tfds (ArrayRecord)"])
  _, grain_metrics = run_train(tmp_path, "grain", "steps=3", *flags["grain (TFDS files)"])
  assert [m["learning/loss"] for m in grain_metrics] == [m["learning/loss"] for m in tfds_metrics]


def _config(flags, *extra):
  return tiny_config(*flags, "per_device_batch_size=4", *extra)


@pytest.mark.parametrize("kind", ["embedded", *KINDS])
@pytest.mark.parametrize("tokenizer", ["sentencepiece", "tiktoken", "huggingface"])
def test_every_dataset_type_with_every_tokenizer(data, tokenizers, kind, tokenizer):
  _, flags = data
  config = _config(flags.get(kind, []), f"tokenizer_path={tokenizers[tokenizer]}", "enable_data_shuffling=false")
  iterator = input_pipeline_interface.create_data_iterator(config, mesh.create_device_mesh(config))
  batch = {k: np.asarray(v) for k, v in next(iterator).items()}
  iterator.close()
  tok = build_tokenizer(config.tokenizer_path, False, False)
  first = batch["inputs"][0][batch["inputs_segmentation"][0] == 1]
  assert first[0] == tok.bos_id
  assert tok.decode(first[1:20]).strip()[:10] in " ".join(
    sample_datasets.split_texts("train", None if kind == "embedded" else LIMIT)
  )


def _take(iterator, n):
  return [{k: np.asarray(v) for k, v in next(iterator).items()} for _ in range(n)]


@pytest.mark.parametrize("kind,shuffle", [("grain", True), ("tfds (TFRecord)", True), ("hf (Parquet)", False)])
def test_resume_is_exact(data, kind, shuffle):
  _, flags = data
  config = _config(flags[kind], f"enable_data_shuffling={shuffle}")
  device_mesh = mesh.create_device_mesh(config)
  reference = input_pipeline_interface.create_data_iterator(config, device_mesh)
  _take(reference, 3)
  state = json.loads(json.dumps(reference.get_state()))
  expected = _take(reference, 3)
  restored = input_pipeline_interface.create_data_iterator(config, device_mesh)
  restored.set_state(state)
  for e, r in zip(expected, _take(restored, 3)):
    for key in e:
      np.testing.assert_array_equal(e[key], r[key])
  reference.close()
  restored.close()


def test_eval_starts_from_the_beginning_every_time(data):
  _, flags = data
  config = _config(flags["grain"], "eval_interval=1", "eval_steps=3")
  device_mesh = mesh.create_device_mesh(config)
  first = _take(input_pipeline_interface.create_eval_iterator(config, device_mesh), 3)
  again = _take(input_pipeline_interface.create_eval_iterator(config, device_mesh), 3)
  for a, b in zip(first, again):
    np.testing.assert_array_equal(a["inputs"], b["inputs"])


def test_target_eval_loss_stops_training(tmp_path, data):
  _, flags = data
  result, metrics = run_train(
    tmp_path, "target", "steps=20", *flags["grain"], "eval_interval=2", "eval_steps=1", "target_eval_loss=100"
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert "Stopping because the eval loss reached target_eval_loss=100.0" in result.stdout
  assert len(metrics) == 2


@pytest.mark.slow
def test_running_out_of_data_stops_cleanly(tmp_path, data):
  _, flags = data
  result, metrics = run_train(
    tmp_path, "epochs", "steps=100000", *flags["hf (Parquet)"], "num_epoch=2", "per_device_batch_size=64"
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert "the training data is used up (num_epoch=2)" in result.stdout
  assert 2 < len(metrics) < 100000 and all(m["learning/total_weights"] > 0 for m in metrics)


@pytest.mark.parametrize(
  "flags,expected",
  [
    (
      ["dataset_type=grain", "grain_train_files=/no/such/*.array_record"],
      "grain_train_files: '/no/such/*.array_record' matches no file",
    ),
    (
      ["dataset_type=hf", "hf_path=parquet", "hf_train_files=/no/such.parquet"],
      "hf_train_files: '/no/such.parquet' matches no file",
    ),
    (
      ["dataset_type=tfds", "dataset_path=/no/such", "dataset_name=c4/en:3.1.0"],
      "is not prepared under dataset_path=/no/such",
    ),
  ],
)
def test_missing_data_is_a_clear_error(tmp_path, flags, expected):
  result, _ = run_train(tmp_path, "missing", "steps=2", *flags)
  assert result.returncode == 2 and "Traceback" not in result.stderr
  assert expected in result.stderr.strip().splitlines()[-1]


def test_missing_column_and_empty_dataset_are_clear_errors(tmp_path, data):
  _, flags = data
  result, _ = run_train(tmp_path, "column", "steps=2", *flags["grain"], "train_data_column=body")
  assert result.returncode == 2 and "records have no column 'body' (they have: text)" in result.stderr
  empty = sample_datasets.write_array_records(str(tmp_path / "empty"), [], num_shards=1)
  result, _ = run_train(tmp_path, "empty", "steps=2", "dataset_type=grain", f"grain_train_files={empty[0]}")
  assert result.returncode == 2 and "holds no records" in result.stderr


def test_invalid_utf8_and_long_documents_are_logged_not_fatal(tmp_path):
  from array_record.python.array_record_module import ArrayRecordWriter  # pylint: disable=import-outside-toplevel

  path = str(tmp_path / "raw.array_record")
  writer = ArrayRecordWriter(path, "group_size:1")
  for i in range(20):
    writer.write(b"caf\xe9 au lait \xff " * (50 if i % 2 else 1) + f"document {i}".encode())
  writer.close()
  result, metrics = run_train(tmp_path, "raw", "steps=2", "dataset_type=grain", f"grain_train_files={path}", "packing=false")
  assert result.returncode == 0, result.stderr[-2000:]
  assert "invalid UTF-8" in result.stderr and "is cut to max_target_length=32" in result.stderr
  assert len(metrics) == 2


def test_preprocess_then_train_on_token_ids(tmp_path, data):
  root, _ = data
  result = run_python(
    [
      "MaxText/preprocess_data.py",
      "--input",
      f"{root}/hf/*.parquet",
      "--output_prefix",
      str(tmp_path / "tok" / "train"),
      "--num_shards",
      "2",
    ]
  )
  assert result.returncode == 0, result.stderr[-2000:]
  documents = len(sample_datasets.split_texts("train", LIMIT)) + len(sample_datasets.split_texts("eval", LIMIT))
  assert f"Wrote {documents} documents" in result.stdout and "in 2 shards" in result.stdout
  result, metrics = run_train(
    tmp_path,
    "tok",
    "steps=2",
    "dataset_type=grain",
    f"grain_train_files={tmp_path}/tok/train.array_record-*",
    "tokenize_train_data=false",
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert len(metrics) == 2


def test_worker_processes_give_the_same_batches(data):
  _, flags = data
  config = _config(flags["grain"])
  with_workers = _config(flags["grain"], "grain_worker_count=1")
  device_mesh = mesh.create_device_mesh(config)
  a = input_pipeline_interface.create_data_iterator(config, device_mesh)
  b = input_pipeline_interface.create_data_iterator(with_workers, device_mesh)
  for x, y in zip(_take(a, 3), _take(b, 3)):
    np.testing.assert_array_equal(x["inputs"], y["inputs"])
  assert b.get_state() == a.get_state()
  a.close()
  b.close()


def test_worker_errors_are_one_line(tmp_path, data):
  _, flags = data
  result, _ = run_train(tmp_path, "werr", "steps=2", *flags["grain"], "grain_worker_count=1", "train_data_column=body")
  assert result.returncode == 2 and "Traceback" not in result.stderr
  assert "records have no column 'body'" in result.stderr.strip().splitlines()[-1]


def test_a_stream_position_resumes_only_with_the_same_data_shards():
  from MaxText.errors import UserError  # pylint: disable=import-outside-toplevel
  from MaxText.input_pipeline.batching import ShardStreamBatcher  # pylint: disable=import-outside-toplevel

  batcher = ShardStreamBatcher(lambda k: lambda epoch, position: iter(()), [0, 1], 4, 2, 1, 8)
  with pytest.raises(UserError, match="is for 2 data shards, this run splits each batch into 4"):
    batcher.set_state({"kind": "stream", "num_shards": 2, "shards": {"0": {}, "1": {}}})
  with pytest.raises(UserError, match="for an unknown number of data shards"):  # a position saved before data shards
    batcher.set_state({"kind": "stream", "process": [0, 2], "stream": {}})


def _train_command(base_dir, metrics_name, steps, *flags):
  args = tiny_args(f"base_output_directory={base_dir}", f"metrics_file={base_dir / metrics_name}.jsonl", f"steps={steps}")
  return [sys.executable, TRAIN_PY, "MaxText/configs/base.yml", "run_name=shards", *args, "learning_rate=1e-2", *flags]


def _run_on_cpus(command, devices):
  result = subprocess.run(command, cwd=REPO_ROOT, env=cpu_env(devices), capture_output=True, text=True, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  return result


@pytest.mark.slow
def test_tfrecord_data_saved_on_2_processes_resumes_on_other_data_shards(tmp_path, data):
  """Upstream's test_checkpoint_resharding.sh for streamed TFRecord data: saved on dcn_data 2 x ici_fsdp 4 (2
  processes, 8 data shards), resumed on 1 process with 8 data shards (exactly) and with 2 (re-split)."""
  _, flags = data
  common = [*flags["tfds (TFRecord)"], "checkpoint_period=3", "learning_rate_schedule_steps=6"]
  _run_on_cpus(_train_command(tmp_path / "reference", "m", 6, *common, "per_device_batch_size=1"), 8)
  codes, outputs = finish_processes(
    start_cpu_processes(_train_command(tmp_path / "saved", "m", 4, *common, "per_device_batch_size=1")), timeout=300
  )
  assert codes == [0, 0], "\n".join(o[-3000:] for o in outputs)
  shutil.copytree(tmp_path / "saved", tmp_path / "resplit")
  same = _run_on_cpus(_train_command(tmp_path / "saved", "resumed", 6, *common, "per_device_batch_size=1"), 8)
  resplit = _run_on_cpus(_train_command(tmp_path / "resplit", "resumed", 6, *common, "per_device_batch_size=4"), 2)

  losses = {run: [m["learning/loss"] for m in read_metrics(tmp_path / run / "m.jsonl")] for run in ("reference", "saved")}
  np.testing.assert_allclose(losses["saved"], losses["reference"][:4], rtol=1e-6)
  resumed = read_metrics(tmp_path / "saved" / "resumed.jsonl")
  assert "Restored the checkpoint of step 3" in same.stdout and "Re-splitting" not in same.stdout
  assert [m["step"] for m in resumed] == [4, 5]
  np.testing.assert_allclose([m["learning/loss"] for m in resumed], losses["reference"][4:], rtol=1e-6)

  assert "Restored the checkpoint of step 3" in resplit.stdout
  assert "Re-splitting the data position of 8 data shards onto 2: this run's shard j finishes the saved shards" in (
    resplit.stdout
  )
  resplit_metrics = read_metrics(tmp_path / "resplit" / "resumed.jsonl")
  assert [m["step"] for m in resplit_metrics] == [4, 5]
  assert all(np.isfinite(m["learning/loss"]) and m["learning/total_weights"] == 8 * 32 for m in resplit_metrics)


def test_preprocess_refuses_to_mix_with_old_shards(tmp_path, data):
  root, _ = data
  args = ["MaxText/preprocess_data.py", "--input", f"{root}/hf/eval.parquet", "--output_prefix", str(tmp_path / "t")]
  assert run_python(args).returncode == 0
  again = run_python([*args, "--num_shards", "3"])
  assert again.returncode == 2 and "1 shards already exist" in again.stderr
