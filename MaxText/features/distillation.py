"""Logit distillation (use_distillation=true): the student learns from a frozen teacher's softened distribution.

For each target token (targets_segmentation != 0), with p_T = softmax(logits / T) and T = distill_temperature,

  loss = distill_alpha x T^2 x KL(teacher p_T || student p_T) + (1 - distill_alpha) x cross-entropy(student, target)

summed over the tokens and divided by their count, as the cross-entropy alone is (so gradient accumulation and the
fractional batch hold). T^2 keeps the soft term's gradient of one scale whatever T (Hinton et al., 2015). The two terms
are logged per token as learning/distill_kl (the KL at temperature T) and learning/distill_ce. Eval is the student's
cross-entropy alone (the teacher is not run): what the student is judged on.

The teacher is a model of its own config (teacher_config: the student's, with teacher_overrides' model keys over
it). Its params are the `teacher_params` slot of the train state: their own abstract params and logical-axis
shardings on the run's mesh, outside the optimizer, passed to the step as a constant (never differentiated). They are
read from teacher_overrides.load_parameters_path at every start, fresh or resumed, and checkpoints do not hold them
(`saved`): they never change, and a teacher is often larger than its student.
"""

import os

import jax
import jax.numpy as jnp
import optax

from MaxText import feature_protocol, max_logging, pyconfig
from MaxText.checkpoints import checkpointing
from MaxText.configuration import attention_selection, config_loader, config_validation, pipeline_schedule
from MaxText.configuration.config_keys.model import SECTIONS as MODEL_SECTIONS
from MaxText.errors import ConfigError
from MaxText.features import pipeline_layout
from MaxText.layers.linears import Gemm
from MaxText.layers.models import Transformer

TEACHER = "teacher_params"  # the slot
KL, CE = "learning/distill_kl", "learning/distill_ce"  # the objective's metrics
PATH_KEY = "teacher_overrides.load_parameters_path"

# teacher_overrides takes the Model section's keys (the architecture, its dims and precision), model_name (a preset
# over them), load_parameters_path (its params) and how its layers go over the pipeline's stages; the other keys are
# the run's, which the student's config sets.
_MODEL_KEYS = frozenset(MODEL_SECTIONS["Model"])
_PIPELINE_KEYS = frozenset({"pipeline_parallel_layers", "num_layers_per_pipeline_stage", "num_pipeline_repeats"})
_TEACHER_KEYS = _MODEL_KEYS | _PIPELINE_KEYS | {"model_name", "load_parameters_path"}
_UNQUANTIZED = "the teacher runs unquantized (it is only read, never trained: quantization is the student's)"
_REFUSED = {key: _UNQUANTIZED for key in ("quantization", "fp8_scaling", "fp8_amax_history_length")}
# Values the student's config derived from base.yml's default (-1: from the model), which the teacher derives again.
_DERIVED_AGAIN = ("num_pipeline_repeats", "num_pipeline_microbatches")


def _typed_overrides(config) -> dict:
  """teacher_overrides' entries, each checked and typed as the same key of the student's config is."""
  defaults = config_loader.base_defaults()
  typed = {}
  for key, value in config.teacher_overrides.items():
    if key not in defaults:
      raise ConfigError(f"teacher_overrides.{key}: unknown config key{config_loader.closest_key_hint(key, defaults)}")
    if key in _REFUSED:
      raise ConfigError(f"teacher_overrides.{key}={config_loader.show_value(value)}: {_REFUSED[key]}")
    if key not in _TEACHER_KEYS:
      raise ConfigError(
        f"teacher_overrides.{key}: the teacher takes the model keys (base.yml's Model section), model_name, "
        f"load_parameters_path and the pipeline's layers per stage; {key} is the run's, set once for student and teacher"
      )
    typed[key] = config_loader.coerce_value(f"teacher_overrides.{key}", value, defaults[key])
  if not typed.get("load_parameters_path"):
    raise ConfigError(
      f"use_distillation=true needs {PATH_KEY}: the trained teacher's params (e.g. <its run>/checkpoints/<step>/items)"
    )
  return typed


def _preset_values(config, model_name: str) -> dict:
  """The model keys of a teacher named by model_name: the config file's (the student's preset left out), then the
  preset's, as a run with that model_name would have them."""
  defaults = config_loader.base_defaults()
  file_values, _ = config_loader.load_config_file(config.config_path, defaults)
  values = {k: file_values[k] for k in _MODEL_KEYS if config.source(k).startswith(config_loader.SOURCE_MODEL)}
  if model_name != "default":
    preset, where = config_loader.load_model_preset(model_name, os.path.dirname(os.path.abspath(config.config_path)))
    values.update({k: config_loader.coerce_value(k, v, defaults[k], where) for k, v in preset.items() if k in _MODEL_KEYS})
  return values


def teacher_config(config) -> pyconfig.Config:
  """The teacher's config: the student's (its mesh, batch, dtypes, ...), with teacher_overrides' keys over its model
  keys (a model_name among them: that preset's keys first), checked and derived as a run's are. Every mistake is a
  ConfigError that names teacher_overrides."""
  typed = _typed_overrides(config)
  values = config.get_keys()
  sources = {key: config.source(key) for key in values}
  defaults = config_loader.base_defaults()
  for key in _DERIVED_AGAIN:
    if config.source(key) == pyconfig.SOURCE_DERIVED:
      values[key] = defaults[key]
  if "model_name" in typed:
    values.update(_preset_values(config, typed["model_name"]))
  values.update(typed, quantization="")
  sources.update(dict.fromkeys(typed, "teacher_overrides"))
  try:
    config_validation.validate_model(values)
    pyconfig.scaled_dims(values, sources)
    values["mlp_activations"] = tuple(values["mlp_activations"])
    if "attention" in typed or config.source("attention") == pyconfig.SOURCE_DERIVED:  # autoselected for the student
      platform = {"gpu_multiprocess": "gpu"}.get(values["hardware"], values["hardware"])
      values["attention"] = attention_selection.select(
        {**values, "attention": typed.get("attention", "autoselected")}, platform
      )
    schedule = pipeline_schedule.resolve(values)
  except ConfigError as e:
    raise ConfigError(f"teacher_overrides: {e}") from None
  if schedule is not None:
    values.update(num_pipeline_repeats=schedule.repeats, num_pipeline_microbatches=schedule.microbatches)
  path = values["load_parameters_path"]
  values["load_parameters_path"] = path if "://" in path else os.path.abspath(os.path.expanduser(path))
  if values["vocab_size"] != config.vocab_size:
    raise ConfigError(
      f"teacher_overrides: the teacher's vocab_size={values['vocab_size']} differs from the student's "
      f"vocab_size={config.vocab_size}: the KL compares the two models' distributions over the same tokens"
    )
  return pyconfig.Config(values, sources)


def losses(student_logits, teacher_logits, batch, alpha: float, temperature: float):
  """The summed distillation loss over the batch's target tokens, their count, and the summed {KL, CE}.

  Args:
    student_logits, teacher_logits: (B, T, V) float32.
    batch: the targets and targets_segmentation (0: padding, which counts for nothing).
  """
  weights = (batch["targets_segmentation"] != 0).astype(jnp.float32)  # (B, T)
  teacher_logits = jax.lax.stop_gradient(teacher_logits)
  student_log_p = jax.nn.log_softmax(student_logits / temperature, axis=-1)
  teacher_log_p = jax.nn.log_softmax(teacher_logits / temperature, axis=-1)
  kl = jnp.sum(jnp.exp(teacher_log_p) * (teacher_log_p - student_log_p), axis=-1)  # (B, T)
  xent = optax.softmax_cross_entropy_with_integer_labels(student_logits, batch["targets"])  # (B, T)
  kl, xent = jnp.sum(kl * weights), jnp.sum(xent * weights)
  loss = alpha * temperature**2 * kl + (1 - alpha) * xent
  return loss, jnp.sum(weights), {KL: jax.lax.stop_gradient(kl), CE: jax.lax.stop_gradient(xent)}


class Distillation(feature_protocol.Feature):
  """use_distillation: the objective against a frozen teacher of its own config, held in the `teacher_params` slot."""

  name = "distillation"
  own_layout = (TEACHER,)  # the teacher's layers are in its own pipeline order (on_start), not the student's

  def __init__(self, config):
    if config.use_dpo:
      raise ConfigError(
        "use_distillation=true and use_dpo=true each replace the loss (a KL to the teacher's tokens, a preference "
        "between two responses); set one"
      )
    self.config = config
    self.alpha, self.temperature = config.distill_alpha, config.distill_temperature
    self.teacher_config = teacher_config(config)
    self.teacher = Transformer(self.teacher_config, Gemm())  # unquantized, untapped, without adapters
    self.abstract_teacher = None  # its params' shapes and shardings (bind_state)

  def slots(self, variables: dict) -> dict:
    """The teacher's params, boxed with their logical axes so that they get their own shardings; zeros, which the
    teacher's checkpoint replaces in on_start."""
    del variables
    shape = (self.config.micro_batch_size_to_load, self.config.max_target_length)
    tokens, rng = jnp.ones(shape, jnp.int32), jax.random.PRNGKey(0)
    positions = jnp.broadcast_to(jnp.arange(shape[1], dtype=jnp.int32), shape)
    params = self.teacher.init({"params": rng, "dropout": rng}, tokens, positions)["params"]
    return {TEACHER: jax.tree.map(jnp.zeros_like, params)}

  def bind_state(self, abstract_state) -> None:
    """Keeps the teacher's abstract params, and checks now, before any compile, that its checkpoint fits them."""
    self.abstract_teacher = abstract_state.slots[TEACHER]
    path = self.teacher_config.load_parameters_path
    tree = checkpointing.tree_metadata(path, PATH_KEY)
    checkpointing.check_checkpoint_fits(tree["params"], self.abstract_teacher, f"{PATH_KEY}={path}")

  def on_start(self, state):
    """The teacher read from its checkpoint, at every start: a checkpoint of the student does not hold it."""
    path = self.teacher_config.load_parameters_path
    params = checkpointing.load_params(path, self.abstract_teacher, self.teacher_config.param_scan_axis, key=PATH_KEY)
    max_logging.log(f"Distillation: the teacher ({self.teacher_config.num_decoder_layers} layers) read from {path}")
    return state.with_slot(TEACHER, pipeline_layout.to_memory(params, self.teacher_config))

  def saved(self, state):
    return state.replace(slots={name: slot for name, slot in state.slots.items() if name != TEACHER})

  def step_constant(self, state, train: bool):
    return state.slots[TEACHER] if train else None

  def objective(self, ctx: feature_protocol.StepContext, constant) -> feature_protocol.Objective | None:
    if not ctx.train:
      return None  # eval: the student's cross-entropy
    batch = ctx.batch
    teacher_logits = self.teacher.apply(
      {"params": jax.lax.stop_gradient(constant)},
      batch["inputs"],
      batch["inputs_position"],
      batch["inputs_segmentation"],
      deterministic=True,
    )
    return feature_protocol.Objective(*losses(ctx.logits, teacher_logits, batch, self.alpha, self.temperature))
