"""GRPO's reward functions (features/grpo_rewards.py): the shipped GSM8K examples, weights, and one line naming the
function for each mistake a reward file can make."""

import os

import numpy as np
import pytest

from MaxText.errors import UserError
from MaxText.features.grpo_rewards import RewardFunctions
from MaxText.tests.helpers import REPO_ROOT

EXAMPLES = os.path.join(REPO_ROOT, "MaxText", "configs", "rl", "gsm8k_rewards.py")
COMPLETIONS = [
  "3 + 4 = 7\n#### 7",  # right, well formed
  "it is 1,200 apples\n#### 1,200",  # right (commas dropped), well formed
  "#### 8\nthen I checked",  # wrong number, and not at the end
  "the answer is 7",  # no ####
]
ANSWERS = ["Tom has 7.\n#### 7", "#### 1200", "#### 7", "#### 7"]


def test_the_shipped_examples_check_the_final_number_and_the_format():
  rewards = RewardFunctions(EXAMPLES, ["gsm8k_exact_answer", "gsm8k_format"], [1.0, 0.5])
  scores = rewards.score(["q"] * 4, COMPLETIONS, {"answer": ANSWERS})
  np.testing.assert_array_equal(scores.per_function["gsm8k_exact_answer"], [1, 1, 0, 0])
  np.testing.assert_array_equal(scores.per_function["gsm8k_format"], [1, 1, 0, 0])
  np.testing.assert_array_equal(scores.total, [1.5, 1.5, 0, 0])
  assert scores.total.dtype == np.float32


def _file(tmp_path, body: str) -> str:
  path = tmp_path / "rewards.py"
  path.write_text(body)
  return str(path)


GOOD = "def good(prompts, completions, **kw):\n  return [1.0] * len(completions)\n"


@pytest.mark.parametrize(
  "body, name, says",
  [
    ("import not_a_module_anywhere\n", "good", "cannot be imported: ModuleNotFoundError: No module named"),
    (GOOD, "missing", "reward function missing: "),
    (
      GOOD + "def bad(prompts, completions, **kw):\n  raise ValueError('no\\nanswer')\n",
      "bad",
      "reward function bad raised ValueError: no answer",
    ),
    (
      GOOD + "def bad(prompts, completions, **kw):\n  return [1.0]\n",
      "bad",
      "reward function bad returned 1 values for 2 completions",
    ),
    (
      GOOD + "def bad(prompts, completions, **kw):\n  return [1.0, float('nan')]\n",
      "bad",
      "reward function bad returned NaN for completion 1",
    ),
    (
      GOOD + "def bad(prompts, completions, **kw):\n  return [1.0, None]\n",
      "bad",
      "reward function bad returned None for completion 1",
    ),
    (
      GOOD + "def bad(prompts, completions, answer, **kw):\n  return [1.0, 1.0]\n",
      "bad",
      "reward function bad raised TypeError: bad() missing 1 required positional argument: 'answer'",
    ),
  ],
)
def test_a_bad_reward_function_is_one_line_naming_it(tmp_path, body, name, says):
  with pytest.raises(UserError) as e:
    RewardFunctions(_file(tmp_path, body), ["good", name]).score(["p", "q"], ["a", "b"], {"question": ["x", "y"]})
  assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_missing_file_is_one_line(tmp_path):
  with pytest.raises(UserError, match=r"^reward_functions_path=.*nothing\.py: no such file$"):
    RewardFunctions(str(tmp_path / "nothing.py"), ["good"])
