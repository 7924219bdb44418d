"""The GRPO keys' rules between keys (use_grpo, features/grpo.py): what a GRPO run needs of the data, the batch and
the other training modes. Each failure is one line naming the key, its value and what would be valid."""

from MaxText.configuration import config_loader
from MaxText.errors import ConfigError

_OTHER_OBJECTIVES = ("use_sft", "use_dpo", "use_distillation")


def reward_function_names(values) -> list[str]:
  """The names of reward_functions, a comma-separated list."""
  return [name.strip() for name in str(values["reward_functions"]).split(",") if name.strip()]


def derive_static(values, sources, set_value) -> None:
  """use_grpo turns the default packing off (a row holds one prompt and one completion) and resolves epsilon_high;
  then checks the keys that need no devices. set_value(values, sources, key, value) sets a derived value."""
  if not values["use_grpo"]:
    return
  for key in _OTHER_OBJECTIVES:
    if values[key]:
      raise ConfigError(f"use_grpo=true and {key}=true are both set: GRPO has its own objective; set one")
  if values["packing"] and config_loader.set_by_user(sources, "packing"):
    raise ConfigError(
      "use_grpo=true needs packing=false (each row holds one prompt and its completion): leave packing unset"
    )
  set_value(values, sources, "packing", False)
  if values["epsilon_high"] is None:
    set_value(values, sources, "epsilon_high", values["grpo_epsilon"])
  if values["epsilon_high"] < values["grpo_epsilon"]:
    raise ConfigError(
      f"epsilon_high={values['epsilon_high']} must be >= grpo_epsilon={values['grpo_epsilon']} (DAPO's clip widens "
      "the upper range only)"
    )
  if values["dataset_type"] == "synthetic":
    raise ConfigError("use_grpo=true generates from prompts: dataset_type=synthetic has none (use hf, grain or tfds)")
  if list(values["train_data_columns"])[:1] != ["prompt"]:
    raise ConfigError(
      f"use_grpo=true reads train_data_columns=['prompt', ...] (the other columns go to the reward functions), not "
      f"{list(values['train_data_columns'])}"
    )
  if values["eval_interval"] > 0:
    raise ConfigError(f"use_grpo=true has no eval loss: set eval_interval=-1, not {values['eval_interval']}")
  if values["max_prefill_predict_length"] >= values["max_target_length"]:
    raise ConfigError(
      f"use_grpo=true samples max_target_length - max_prefill_predict_length tokens: max_prefill_predict_length="
      f"{values['max_prefill_predict_length']} must be below max_target_length={values['max_target_length']}"
    )
  _check_rewards(values)


def _check_rewards(values) -> None:
  names = reward_function_names(values)
  if not values["reward_functions_path"] or not names:
    raise ConfigError(
      "use_grpo=true needs reward_functions_path (a Python file) and reward_functions (names in it, comma-separated), "
      "e.g. reward_functions_path=MaxText/configs/rl/gsm8k_rewards.py reward_functions=gsm8k_exact_answer"
    )
  weights = list(values["reward_weights"])
  if weights and len(weights) != len(names):
    raise ConfigError(
      f"reward_weights={weights} has {len(weights)} weights for {len(names)} reward functions ({', '.join(names)}): "
      "give one per function, or none"
    )


def check_batch(values, batch_shards: int) -> None:
  """A batch holds whole groups: its rows are prompts x num_generations (after the device values are derived), and
  its prompts, loaded before generation, split over the batch shards."""
  if not values["use_grpo"]:
    return
  rows, generations = values["global_batch_size_to_train_on"], values["num_generations"]
  if rows % generations:
    raise ConfigError(
      f"use_grpo=true: the batch of {rows} rows (per_device_batch_size x devices x gradient_accumulation_steps) must "
      f"be a multiple of num_generations={generations}: each prompt's {generations} completions train together"
    )
  if values["global_batch_size_to_load"] != rows:
    raise ConfigError(
      f"use_grpo=true needs a whole per_device_batch_size (not {values['per_device_batch_size']}): every loaded row "
      "is a completion that trains"
    )
  prompts = rows // generations
  if prompts % batch_shards:
    raise ConfigError(
      f"use_grpo=true: the batch's {prompts} prompts ({rows} rows / num_generations={generations}) do not split over "
      f"the {batch_shards} batch shards of the mesh: raise per_device_batch_size or gradient_accumulation_steps, or "
      "lower num_generations"
    )
