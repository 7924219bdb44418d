"""Keys of base.yml's GRPO section: reinforcement learning from verifiable rewards (features/grpo.py)."""

from MaxText.configuration.config_keys import NON_NEGATIVE, POSITIVE, Key, On, Range

_GRPO = On("use_grpo", True)

SECTIONS = {
  "GRPO": {
    "use_grpo": Key("Train with GRPO on generated completions of train_data_columns [prompt] (docs/fine_tuning.md)."),
    "num_generations": Key(
      "Completions sampled per prompt: the group whose rewards make the advantages.",
      range=Range(2, says="an integer >= 2 (GRPO compares the completions of a group)"),
      acts_with=_GRPO,
    ),
    "num_iterations": Key(
      "Optimizer steps per batch of completions; above 1 the old policy's log-probs make the ratio.",
      range=POSITIVE,
      acts_with=_GRPO,
    ),
    "grpo_beta": Key(
      "The k3 KL penalty's coefficient against the reference; 0: no reference kept.", range=NON_NEGATIVE, acts_with=_GRPO
    ),
    "grpo_epsilon": Key(
      "The ratio is clipped to [1 - grpo_epsilon, 1 + epsilon_high].", range=Range(0, low_open=True), acts_with=_GRPO
    ),
    "epsilon_high": Key(
      "The clip's upper range (DAPO); null: grpo_epsilon.",
      range=Range(0, low_open=True, also=(None,), says="null (grpo_epsilon) or > 0"),
      kind="float",
      acts_with=_GRPO,
    ),
    "loss_algo": Key(
      "grpo: a ratio per token; gspo-token: the sequence's mean log-ratio, per token (GSPO).",
      choices=("grpo", "gspo-token"),
      acts_with=_GRPO,
    ),
    "loss_agg_mode": Key(
      "token-mean: over all tokens; sequence-mean-token-mean: of each sequence's mean; sequence-mean: of its sum.",
      choices=("token-mean", "sequence-mean-token-mean", "sequence-mean"),
      acts_with=_GRPO,
    ),
    "reward_functions_path": Key("A Python file of reward functions f(prompts, completions, **columns) -> list[float]."),
    "reward_functions": Key("Comma-separated names of the reward functions in reward_functions_path.", acts_with=_GRPO),
    "reward_weights": Key("One weight per reward function (the reward is their weighted sum); []: all 1.", acts_with=_GRPO),
    "grpo_samples_interval": Key(
      "Write a few prompts and completions to <run_dir>/completions.txt every this many steps; 0: never.",
      range=NON_NEGATIVE,
      acts_with=_GRPO,
    ),
  },
}
