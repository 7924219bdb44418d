"""Keys of base.yml's Checkpointing, Optimizer, LoRA and Distillation sections."""

from MaxText.configuration.common_types import OPTIMIZERS
from MaxText.configuration.config_keys import FRACTION, NON_NEGATIVE, POSITIVE, Key, On, Range

_DECAY = Range(0, 1, high_open=True)
_CHECKPOINTS = On("enable_checkpointing", True)
_LORA = On("enable_lora", True)
_MUON = On("opt_type", "muon")
_DISTILL = On("use_distillation", True)

SECTIONS = {
  "Checkpointing": {
    "enable_checkpointing": Key(
      "Save to <run_dir>/checkpoints/<step>: every checkpoint_period steps, at the last step, on SIGTERM."
    ),
    "async_checkpointing": Key(
      "Write in the background; the loop only waits for the device-to-host copy.", acts_with=_CHECKPOINTS
    ),
    "checkpoint_period": Key(
      "Save every this many steps (from step 0), and at the last step.", range=POSITIVE, acts_with=_CHECKPOINTS
    ),
    "save_checkpoint_on_completion": Key("Also save the last step; false: only every checkpoint_period (upstream 2024)."),
    "data_position_on_resume": Key(
      "restore: a resume continues the data exactly; reset: restore model and optimizer, start the data afresh.",
      choices=("restore", "reset"),
    ),
    "max_num_checkpoints_to_keep": Key(
      "Keep the newest N checkpoints; null keeps all.",
      range=Range(1, also=(None,), says="null (keep all) or a positive integer"),
      kind="int",
    ),
    "load_parameters_path": Key("Start from these params (an Orbax PyTree with params), e.g. <run>/checkpoints/<N>/items."),
    "load_full_state_path": Key(
      "Start from this whole train state (params, optimizer, step); with LoRA a LoRA run's, on the above."
    ),
    "force_unroll": Key("generate_param_only_checkpoint.py: write per-layer params (layers_i) from scanned ones."),
  },
  "Optimizer": {
    "opt_type": Key(
      "The optimizer, after global-norm clipping: adamw | adam_pax (Pax's Adam, upstream's gpt3) | sgd | muon (+ AdamW).",
      choices=OPTIMIZERS,
    ),
    "adam_b1": Key("Adam's first-moment decay.", range=_DECAY),
    "adam_b2": Key("Adam's second-moment decay.", range=_DECAY),
    "adam_eps": Key("Added to the root of the second moment.", range=NON_NEGATIVE),
    "adam_eps_root": Key("Added to the second moment inside the root.", range=NON_NEGATIVE),
    "adam_weight_decay": Key("Decoupled weight decay (AdamW), times the learning rate.", range=NON_NEGATIVE),
    "muon_beta": Key("Muon's momentum decay (Nesterov).", range=_DECAY, acts_with=_MUON),
    "muon_weight_decay": Key(
      "Muon's decoupled weight decay on the matrices, times the learning rate.", range=NON_NEGATIVE, acts_with=_MUON
    ),
    "muon_consistent_rms": Key(
      "Muon's updates scaled by this x sqrt(max(fan_in, fan_out)), 0.2: AdamW's size; null: sqrt(max(1, fan_out / fan_in)).",
      range=Range(0, low_open=True, also=(None,), says="null (optax's width scaling) or > 0"),
      acts_with=_MUON,
      kind="float",
    ),
    "gradient_clipping_threshold": Key("Clip the gradients to this global norm; 0 disables.", range=NON_NEGATIVE),
    "gradient_accumulation_steps": Key(
      "Microbatches per update: the update of one batch that many times larger.", range=POSITIVE
    ),
    "z_loss_multiplier": Key(
      "Adds this x logsumexp(logits)^2 per counted target token to the training loss (logged as learning/z_loss); 0: off.",
      range=NON_NEGATIVE,
    ),
    "learning_rate": Key("Peak learning rate, reached at the end of the warmup.", range=NON_NEGATIVE),
    "cosine_learning_rate_final_fraction": Key(
      "The cosine decays to learning_rate x this at learning_rate_schedule_steps (then 0).", range=FRACTION
    ),
    "warmup_steps_fraction": Key("Linear warmup over this fraction of learning_rate_schedule_steps.", range=FRACTION),
    "learning_rate_schedule_steps": Key(
      "Length of the warmup + cosine schedule; -1: steps.", range=Range(1, also=(-1,), says="positive (or -1 for steps)")
    ),
  },
  "LoRA": {
    "enable_lora": Key("Train LoRA adapters on the layers lora_module_path selects; the rest stays frozen."),
    "lora_rank": Key("The adapters' rank r.", range=POSITIVE, acts_with=_LORA),
    "lora_alpha": Key(
      "The adapters' output is scaled by lora_alpha / lora_rank.", range=Range(0, low_open=True), acts_with=_LORA
    ),
    "lora_module_path": Key(
      "A regex searched in the dense layers' names (MaxText/list_layers.py lists them; '.' for '/' too).",
      acts_with=_LORA,
    ),
    "lora_weight_qtype": Key(
      "QLoRA: the frozen base's dense kernels held as int8 or fp8 (per channel) or nf4 (blocks of 64); '': as is.",
      choices=("", "int8", "fp8", "nf4"),
      acts_with=_LORA,
    ),
  },
  "Distillation": {
    "use_distillation": Key("Train against a frozen teacher's logits (features/distillation.py); set teacher_overrides."),
    "distill_alpha": Key(
      "The soft term's weight: alpha x T^2 x KL(teacher || student) + (1 - alpha) x cross-entropy.",
      range=FRACTION,
      acts_with=_DISTILL,
    ),
    "distill_temperature": Key(
      "T: both models' logits are divided by it before the KL (> 1 softens them).",
      range=Range(0, low_open=True),
      acts_with=_DISTILL,
    ),
    "teacher_overrides": Key(
      "The teacher: model keys over the student's (model_name: that preset's) and its load_parameters_path.",
      acts_with=_DISTILL,
    ),
  },
}
