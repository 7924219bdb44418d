"""Logit distillation (features/distillation.py): the loss against a float64 reference, zero loss and gradient when
the student is its teacher, the teacher's config from teacher_overrides (in YAML and as teacher_overrides.<key>= on
the command line) and its one-line mistakes, and a run whose checkpoints leave the teacher out and whose resume reads
it again."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from MaxText.aot import aot_compile
from MaxText.checkpoints import checkpointing
from MaxText.configuration import config_loader
from MaxText.errors import ConfigError
from MaxText.features import distillation, selection
from MaxText.layers import layer_names
from MaxText.runtime import mesh, sharding
from MaxText.tests.helpers import BASE_YML, LORA, run_train, tiny_config, token_batch
from MaxText.tests.tiny_models import padded_token_batch
from MaxText.training import starting_state, train_state, train_step, training_setup

TEACHER_PATH = "teacher_overrides.load_parameters_path=/nowhere/teacher/items"  # read at a run's start only


def _reference(student, teacher, batch, alpha, temperature):
  """alpha x T^2 x KL(teacher_T || student_T) + (1 - alpha) x cross-entropy per counted token, in float64 NumPy."""

  def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))

  student, teacher = np.asarray(student, np.float64), np.asarray(teacher, np.float64)
  log_q, log_p = log_softmax(student / temperature), log_softmax(teacher / temperature)
  kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)
  targets = np.asarray(batch["targets"])
  xent = -np.take_along_axis(log_softmax(student), targets[..., None], -1)[..., 0]
  counted = np.asarray(batch["targets_segmentation"]) != 0
  return (alpha * temperature**2 * kl[counted].sum() + (1 - alpha) * xent[counted].sum()) / counted.sum()


@pytest.mark.parametrize("alpha,temperature", [(0.5, 1.0), (0.3, 2.5), (1.0, 0.7), (0.0, 3.0)])
def test_the_loss_is_the_formula_over_the_counted_tokens(alpha, temperature):
  batch = token_batch(2, 32, segmentation=jnp.ones((2, 32), jnp.int32).at[1, 20:].set(0))
  student = 3 * jax.random.normal(jax.random.PRNGKey(1), (2, 32, 4096))
  teacher = 3 * jax.random.normal(jax.random.PRNGKey(2), (2, 32, 4096))
  loss, weights, metrics = distillation.losses(student, teacher, batch, alpha, temperature)
  assert float(weights) == 52
  assert float(loss / weights) == pytest.approx(_reference(student, teacher, batch, alpha, temperature), rel=1e-5)
  assert float(loss) == pytest.approx(
    alpha * temperature**2 * float(metrics[distillation.KL]) + (1 - alpha) * float(metrics[distillation.CE]), rel=1e-6
  )


def _student_and_teacher(*args):
  config = tiny_config("use_distillation=true", TEACHER_PATH, *args)
  features = selection.for_config(config)
  model = training_setup.create_model(config, features)
  tokens = jnp.ones((2, 32), jnp.int32)
  rng = jax.random.PRNGKey(0)
  params = model.init({"params": rng, "dropout": rng}, tokens, tokens)["params"]
  return config, features, model, params


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_a_student_that_is_its_teacher_has_zero_loss_and_zero_gradient_at_alpha_1(temperature):
  config, features, model, params = _student_and_teacher("distill_alpha=1", f"distill_temperature={temperature}")
  batch = token_batch(2, 32)

  def loss(p):
    total, aux = train_step.loss_fn(
      model, config, features, p, batch, jax.random.PRNGKey(0), True, None, {"distillation": params}
    )
    return total / aux.weights, aux

  (value, aux), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  assert float(value) == 0.0 and float(aux.metrics[distillation.KL]) == 0.0
  assert float(aux.metrics[distillation.CE]) > 1.0  # a random model: the hard term is there, at weight 0
  assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads)) < 1e-7


def test_eval_is_the_students_cross_entropy():
  config, features, model, params = _student_and_teacher("distill_alpha=1")
  batch = token_batch(2, 32)
  plain = tiny_config()
  expected, _ = train_step.loss_fn(model, plain, (), params, batch, jax.random.PRNGKey(0), False)
  state = train_state.TrainState.create(params, optax.identity())
  metrics = train_step.eval_step(model, config, features, state, batch)
  assert float(metrics["evaluation/total_loss"]) == pytest.approx(float(expected), rel=1e-6)


def test_the_teacher_is_the_students_model_with_its_overrides_over_it():
  config = tiny_config(
    "use_distillation=true", TEACHER_PATH, "teacher_overrides.base_num_decoder_layers=4", "teacher_overrides.base_emb_dim=64"
  )
  teacher = distillation.teacher_config(config)
  assert (teacher.num_decoder_layers, teacher.emb_dim, teacher.mlp_dim) == (4, 64, config.mlp_dim)
  assert teacher.load_parameters_path == "/nowhere/teacher/items" and teacher.source("base_emb_dim") == "teacher_overrides"
  assert (teacher.per_device_batch_size, teacher.dtype, teacher.vocab_size) == (2, "float32", 4096)  # the run's


def test_a_teacher_preset_replaces_the_students_model_keys():
  config = tiny_config("use_distillation=true", TEACHER_PATH, "teacher_overrides.model_name=llama2-7b", "vocab_size=32000")
  teacher = distillation.teacher_config(config)
  assert (teacher.emb_dim, teacher.num_decoder_layers, teacher.head_dim) == (4096, 32, 128)
  assert (config.emb_dim, config.num_decoder_layers) == (32, 2)


def test_teacher_overrides_nest_in_yaml_and_merge_with_the_command_line(tmp_path):
  path = tmp_path / "distill.yml"
  path.write_text(
    f"base_config: {BASE_YML}\nuse_distillation: true\nteacher_overrides:\n  base_num_decoder_layers: 8\n"
    "  load_parameters_path: /t/items\n",
    encoding="utf-8",
  )
  values, sources = config_loader.load_raw_config(["t", str(path), "teacher_overrides.base_emb_dim=64"], {})
  assert values["teacher_overrides"] == {
    "base_num_decoder_layers": 8,
    "load_parameters_path": "/t/items",
    "base_emb_dim": "64",
  }
  assert sources["teacher_overrides"] == config_loader.SOURCE_CLI
  with pytest.raises(ConfigError, match=r"teacher_overrides=3 is not a mapping of keys: write teacher_overrides.<key>="):
    config_loader.load_raw_config(["t", BASE_YML, "teacher_overrides=3"], {})


@pytest.mark.parametrize(
  "args,message",
  [
    (
      ["teacher_overrides.base_emb_dimm=64"],
      "teacher_overrides.base_emb_dimm: unknown config key; did you mean 'base_emb_dim'?",
    ),
    (["teacher_overrides.steps=3"], "teacher_overrides.steps: the teacher takes the model keys"),
    (["teacher_overrides.base_emb_dim=wide"], "teacher_overrides.base_emb_dim=wide is not an integer"),
    (["teacher_overrides.base_num_query_heads=3"], "teacher_overrides: base_num_query_heads=3 must be a multiple of"),
    (["teacher_overrides.quantization=int8"], "teacher_overrides.quantization=int8: the teacher runs unquantized"),
    (
      ["teacher_overrides.vocab_size=320"],
      "the teacher's vocab_size=320 differs from the student's vocab_size=4096: the KL compares the two models'",
    ),
    (["use_dpo=true"], "use_distillation=true and use_dpo=true each replace the loss"),
  ],
)
def test_a_teacher_mistake_is_one_line(args, message):
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("?", r"\?")):
    selection.for_config(tiny_config("use_distillation=true", TEACHER_PATH, *args))


def test_a_teacher_without_params_is_one_line():
  with pytest.raises(ConfigError, match=r"use_distillation=true needs teacher_overrides.load_parameters_path"):
    selection.for_config(tiny_config("use_distillation=true"))


# ---- with gradient accumulation and LoRA ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def teacher_items(tmp_path_factory) -> str:
  """A 4-layer teacher's checkpoint: one train.py step of the tiny model."""
  tmp_path = tmp_path_factory.mktemp("teacher")
  result, _ = run_train(tmp_path, "teacher", "steps=1", "base_num_decoder_layers=4", "async_checkpointing=false")
  assert result.returncode == 0, result.stderr[-3000:]
  return str(tmp_path / "teacher" / "checkpoints" / "0" / "items")


def _distilled_steps(teacher_items: str, *args, steps: int = 2):
  """`steps` compiled train steps of the tiny student distilled from teacher_items on tiny_models'
  padded_token_batch: (the state they start from, the final state, each step's loss)."""
  config = tiny_config(
    "use_distillation=true",
    "distill_temperature=2",
    "teacher_overrides.base_num_decoder_layers=4",
    f"teacher_overrides.load_parameters_path={teacher_items}",
    "learning_rate=1e-2",
    "warmup_steps_fraction=0",
    *args,
  )
  device_mesh = mesh.create_device_mesh(config)
  setup = training_setup.build(config, device_mesh)
  start = starting_state.start(setup.features, setup.init_state(config, device_mesh))
  first = jax.device_get(start)
  step = aot_compile.compile_train_step(setup, config, device_mesh)
  batch = jax.device_put(padded_token_batch(), sharding.data_sharding(config, device_mesh))
  state, losses = start, []
  with sharding.logical_context(device_mesh, config):
    for _ in range(steps):
      state, metrics = step(state, batch)
      losses.append(float(metrics["learning/loss"]))
  return first, jax.device_get(state), losses


def test_gradient_accumulation_gives_the_large_batchs_steps(teacher_items):
  """SGD: its updates are the gradients (Adam's would magnify rounding in the tiny ones)."""
  _, one, losses = _distilled_steps(teacher_items, "opt_type=sgd", "per_device_batch_size=2")
  _, accumulated, accumulated_losses = _distilled_steps(
    teacher_items, "opt_type=sgd", "per_device_batch_size=1", "gradient_accumulation_steps=2"
  )
  np.testing.assert_allclose(accumulated_losses, losses, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(accumulated.params), jax.tree.leaves(one.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_with_lora_the_adapters_move_and_the_base_and_the_teacher_do_not(teacher_items):
  start, end, losses = _distilled_steps(teacher_items, *LORA)
  assert np.isfinite(losses).all() and losses[1] < losses[0]
  for (keys, old), new in zip(layer_names.flatten(start.params), jax.tree.leaves(end.params)):
    assert (not np.array_equal(old, new)) == (keys[-1] in ("lora_a", "lora_b")), keys
  teacher = checkpointing.load_params(teacher_items, jax.tree.map(_on_one_device, start.slots[distillation.TEACHER]))
  for loaded, old, new in zip(
    *(jax.tree.leaves(t) for t in (teacher, start.slots[distillation.TEACHER], end.slots[distillation.TEACHER]))
  ):
    np.testing.assert_array_equal(old, loaded)
    np.testing.assert_array_equal(new, loaded)
  opt_state_paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(end.opt_state)]
  assert opt_state_paths and not any(distillation.TEACHER in path for path in opt_state_paths)


def _on_one_device(x):
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))


# ---- against transformers ------------------------------------------------------------------------------------------

# The teacher: twice the student's layers (tiny_models.HF_LLAMA's 2), wider, the same vocabulary (320).
HF_TEACHER = {"num_hidden_layers": 4, "hidden_size": 96, "intermediate_size": 128}
TEACHER_KEYS = {"base_num_decoder_layers": 4, "base_emb_dim": 96, "base_mlp_dim": 128}
LENGTH = 64


def _hf_batch() -> dict:
  """Two rows of 64 random tokens of the 320, the second padded from token 40."""
  tokens = np.random.default_rng(7).integers(0, 320, (2, LENGTH + 1)).astype(np.int32)
  segmentation = np.ones((2, LENGTH), np.int32)
  segmentation[1, 40:] = 0
  positions = np.broadcast_to(np.arange(LENGTH, dtype=np.int32), (2, LENGTH))
  return {
    "inputs": tokens[:, :-1],
    "inputs_position": positions,
    "inputs_segmentation": segmentation,
    "targets": tokens[:, 1:],
    "targets_position": positions,
    "targets_segmentation": segmentation,
  }


def _transformers_loss(student_hf: str, teacher_hf: str, batch: dict, alpha: float, temperature: float) -> float:
  """The loss from the two transformers models' logits on the batch's inputs, the KL and the cross-entropy by torch."""
  import torch  # pylint: disable=import-outside-toplevel  # requirements-test.txt
  import torch.nn.functional as F  # pylint: disable=import-outside-toplevel

  from MaxText.hf_conversion import logit_check  # pylint: disable=import-outside-toplevel

  student = torch.from_numpy(logit_check.hf_logits(student_hf, batch["inputs"])).double()
  teacher = torch.from_numpy(logit_check.hf_logits(teacher_hf, batch["inputs"])).double()
  log_q, log_p = F.log_softmax(student / temperature, -1), F.log_softmax(teacher / temperature, -1)
  kl = F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)  # KL(p || q) per token
  targets = torch.from_numpy(batch["targets"]).long()
  xent = F.cross_entropy(student.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)
  counted = torch.from_numpy(batch["targets_segmentation"] != 0).double()
  loss = alpha * temperature**2 * (kl * counted).sum() + (1 - alpha) * (xent * counted).sum()
  return float(loss / counted.sum())


def _our_loss(student_yml: str, student_params: str, teacher: tuple[str, str], batch: dict, alpha, temperature):
  """Our training loss of the student (a converted model.yml with these params) against the teacher ((model.yml,
  params) converted), the teacher's model built from TEACHER_KEYS over the student's."""
  from MaxText.hf_conversion import logit_check  # pylint: disable=import-outside-toplevel

  config, model, student = logit_check.converted_model(student_yml, student_params, LENGTH)
  _, _, teacher_params = logit_check.converted_model(*teacher, LENGTH)
  teacher_keys = {**TEACHER_KEYS, "load_parameters_path": teacher[1]}
  config = config.replace(
    use_distillation=True, distill_alpha=alpha, distill_temperature=temperature, teacher_overrides=teacher_keys
  )
  features = selection.for_config(config)

  def loss(student, teacher):
    total, aux = train_step.loss_fn(
      model, config, features, student, batch, jax.random.PRNGKey(0), True, None, {"distillation": teacher}
    )
    return total / aux.weights

  with jax.default_matmul_precision("float32"):
    return float(jax.jit(loss)(student, teacher_params))


def _converted(hf_dir: str, directory) -> tuple[str, str]:
  """(model.yml, params) of hf_dir converted to MaxText."""
  from MaxText.hf_conversion import converter  # pylint: disable=import-outside-toplevel

  converter.to_maxtext(hf_dir, str(directory))
  return str(directory / converter.MODEL_YML), str(directory / converter.PARAMS_DIR)


def _assert_equal(ours: float, theirs: float):
  print(f"ours {ours:.8g}, transformers {theirs:.8g}, relative {abs(ours - theirs) / theirs:.1e}")
  assert ours == pytest.approx(theirs, rel=1e-5)


def _hf_student_and_teacher(tmp_path):
  """Tiny transformers llamas (tiny_models.hf_llama): the student, and a teacher of HF_TEACHER's size."""
  from MaxText.tests.tiny_models import hf_llama  # pylint: disable=import-outside-toplevel

  return hf_llama(tmp_path / "student_hf"), hf_llama(tmp_path / "teacher_hf", **HF_TEACHER)


def test_the_loss_equals_transformers_on_the_student_and_a_larger_teacher(tmp_path):
  student_hf, teacher_hf = _hf_student_and_teacher(tmp_path)
  student_yml, student_params = _converted(student_hf, tmp_path / "student")
  teacher = _converted(teacher_hf, tmp_path / "teacher")
  batch = _hf_batch()
  ours = _our_loss(student_yml, student_params, teacher, batch, 0.7, 2.0)
  _assert_equal(ours, _transformers_loss(student_hf, teacher_hf, batch, 0.7, 2.0))


@pytest.mark.slow
def test_a_distilled_student_exported_to_transformers_gives_our_loss(tmp_path):
  """5 steps of train.py distil the converted student from the converted larger teacher; the student exported to
  transformers (convert_checkpoint.py to_hf), with the teacher, gives our loss on the run's last checkpoint."""
  from MaxText import train  # pylint: disable=import-outside-toplevel
  from MaxText.hf_conversion import converter  # pylint: disable=import-outside-toplevel
  from MaxText.tests.helpers import TRAIN_PY, run_entry_point  # pylint: disable=import-outside-toplevel

  student_hf, teacher_hf = _hf_student_and_teacher(tmp_path)
  student_yml, student_params = _converted(student_hf, tmp_path / "student")
  teacher = _converted(teacher_hf, tmp_path / "teacher")
  teacher_keys = [f"teacher_overrides.{key}={value}" for key, value in TEACHER_KEYS.items()]
  run = run_entry_point(
    train.main,
    [
      TRAIN_PY,
      student_yml,
      "run_name=distilled",
      f"base_output_directory={tmp_path}",
      f"load_parameters_path={student_params}",
      "use_distillation=true",
      "distill_alpha=0.7",
      "distill_temperature=2",
      *teacher_keys,
      f"teacher_overrides.load_parameters_path={teacher[1]}",
      "dataset_type=synthetic",
      "steps=5",
      "learning_rate=1e-2",
      "warmup_steps_fraction=0",
      "per_device_batch_size=2",
      f"max_target_length={LENGTH}",
      "dtype=float32",
      "enable_tensorboard=false",
      "async_checkpointing=false",
    ],
  )
  assert run.returncode == 0, run.stderr[-3000:]
  exported = converter.to_hf(str(tmp_path / "distilled"), str(tmp_path / "exported_hf"))
  batch = _hf_batch()
  ours = _our_loss(student_yml, str(tmp_path / "distilled" / "checkpoints" / "4" / "items"), teacher, batch, 0.7, 2.0)
  assert ours != pytest.approx(_our_loss(student_yml, student_params, teacher, batch, 0.7, 2.0), rel=1e-3)  # it moved
  _assert_equal(ours, _transformers_loss(exported, teacher_hf, batch, 0.7, 2.0))


@pytest.mark.slow
def test_checkpoints_leave_the_teacher_out_and_a_resume_reads_it_again(tmp_path):
  """A 4-layer teacher trained 2 steps; the 2-layer student distilled 2 steps (checkpointed), then resumed to 4: its
  checkpoints hold no teacher, the resumed run reads it again and its losses continue the first run's."""
  result, _ = run_train(tmp_path, "teacher", "steps=2", "base_num_decoder_layers=4", "async_checkpointing=false")
  assert result.returncode == 0, result.stderr[-3000:]
  teacher = [
    "use_distillation=true",
    "distill_temperature=2",
    "teacher_overrides.base_num_decoder_layers=4",
    f"teacher_overrides.load_parameters_path={tmp_path}/teacher/checkpoints/1/items",
    "checkpoint_period=2",
    "async_checkpointing=false",
  ]
  first, metrics = run_train(tmp_path, "student", "steps=2", *teacher)
  assert first.returncode == 0, first.stderr[-3000:]
  tree = checkpointing.tree_metadata(str(tmp_path / "student" / "checkpoints" / "1" / "items"), "the checkpoint")
  assert sorted(tree) == ["opt_state", "params", "step"]
  resumed, more = run_train(tmp_path, "student", "steps=4", *teacher, metrics_name="resumed")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Distillation: the teacher (4 layers) read from" in resumed.stdout + resumed.stderr
  assert [m["step"] for m in more] == [2, 3]
  for m in metrics + more:
    expected = 0.5 * 4 * m[distillation.KL] + 0.5 * m[distillation.CE]
    assert m["learning/loss"] == pytest.approx(expected, rel=1e-5)
    assert m[distillation.KL] > 0


# The learning test's runs: the tiny model 64 wide, 64 tokens a row, 8 rows a step, on the embedded corpus.
LEARNING = [
  "base_emb_dim=64",
  "base_mlp_dim=128",
  "head_dim=16",
  "max_target_length=64",
  "per_device_batch_size=8",
  "learning_rate=3e-3",
  "eval_steps=4",
]


@pytest.mark.slow
def test_a_student_distilled_from_a_deeper_teacher_beats_the_same_student_on_hard_labels(tmp_path):
  """An 8-layer teacher trained 300 steps; a 4-layer student distilled from it 50 steps ends with a lower eval
  cross-entropy than the same student (same init, same batches) trained 50 steps on the labels alone (6.48 against
  6.84). About a minute here."""
  teacher, _ = run_train(
    tmp_path, "teacher", *LEARNING, "steps=300", "base_num_decoder_layers=8", "checkpoint_period=300", "eval_interval=300"
  )
  assert teacher.returncode == 0, teacher.stderr[-3000:]
  student = [*LEARNING, "steps=50", "base_num_decoder_layers=4", "enable_checkpointing=false", "eval_interval=50"]
  hard, hard_metrics = run_train(tmp_path, "hard_labels", *student)
  assert hard.returncode == 0, hard.stderr[-3000:]
  distilled, metrics = run_train(
    tmp_path,
    "distilled",
    *student,
    "use_distillation=true",
    "distill_alpha=0.9",
    "distill_temperature=1",
    "teacher_overrides.base_num_decoder_layers=8",
    f"teacher_overrides.load_parameters_path={tmp_path}/teacher/checkpoints/299/items",
  )
  assert distilled.returncode == 0, distilled.stderr[-3000:]
  [hard_eval] = [m["eval/loss"] for m in hard_metrics if "eval/loss" in m]
  [distilled_eval] = [m["eval/loss"] for m in metrics if "eval/loss" in m]
  print(f"eval cross-entropy after 50 steps: distilled {distilled_eval:.4f}, hard labels {hard_eval:.4f}")
  assert distilled_eval < hard_eval - 0.1
  assert metrics[-1][distillation.KL] < metrics[0][distillation.KL] / 2  # the student moved towards the teacher
