"""--check_logits: MaxText and transformers in float32 on the same fixed random tokens, compared.

Prints `logit check: max_abs_diff=<x> kl=<y>` (KL(transformers || MaxText) per token, averaged).
"""

import numpy as np

from MaxText.errors import UserError

TOLERANCE = 1e-3
SEQUENCE_LENGTH = 64
BATCH = 2


def random_tokens(vocab_size: int, length: int = SEQUENCE_LENGTH, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, vocab_size, size=(BATCH, length), dtype=np.int32)


def require_torch():
  """(torch, transformers), or a UserError that says how to install them."""
  try:
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise UserError(
      f"--check_logits needs torch and transformers ({e.name} is missing): pip install -r requirements-test.txt"
    ) from None
  return torch, transformers


def hf_logits(hf_dir: str, tokens: np.ndarray, hidden_states: bool = False):
  """float32 logits (B, T, V) of the transformers model in hf_dir (and its hidden states if asked)."""
  torch, transformers = require_torch()
  model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
  model.eval()
  with torch.no_grad():
    out = model(torch.from_numpy(tokens.astype(np.int64)), output_hidden_states=hidden_states)
  logits = out.logits.float().numpy()
  if hidden_states:
    return logits, [h.float().numpy() for h in out.hidden_states]
  return logits


def converted_model(model_yml: str, params_dir: str, length: int, scan_layers: bool = True, **overrides):
  """(config, model, params) of a converted model in float32 on one device, for sequences of `length` tokens."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from MaxText.checkpoints import checkpointing  # pylint: disable=import-outside-toplevel
  from MaxText.hf_conversion import converter  # pylint: disable=import-outside-toplevel
  from MaxText.layers.models import Transformer  # pylint: disable=import-outside-toplevel

  config = converter.maxtext_config(
    model_yml, dtype="float32", weight_dtype="float32", max_target_length=length, scan_layers=scan_layers, **overrides
  )
  model = Transformer(config)
  tokens = jnp.zeros((1, length), jnp.int32)
  rng = jax.random.PRNGKey(0)
  abstract = jax.eval_shape(lambda: model.init({"params": rng, "dropout": rng}, tokens, tokens))["params"]
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), nn.unbox(abstract))
  return config, model, checkpointing.load_params(params_dir, abstract, config.param_scan_axis)


def maxtext_logits(model_yml: str, params_dir: str, tokens: np.ndarray, scan_layers: bool = True, intermediates=False):
  """float32 logits (B, T, V) of MaxText with the params of params_dir (and each layer's output if asked)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  length = tokens.shape[1]
  _, model, params = converted_model(model_yml, params_dir, length, scan_layers)
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens.shape)
  with jax.default_matmul_precision("float32"):
    if intermediates:
      logits, state = model.apply({"params": params}, tokens, positions, capture_intermediates=True)
      return np.asarray(logits), state["intermediates"]
    return np.asarray(model.apply({"params": params}, tokens, positions))


def compare(reference: np.ndarray, logits: np.ndarray) -> tuple[float, float]:
  """(max |reference - logits|, mean over tokens of KL(softmax(reference) || softmax(logits)))."""
  ref, got = reference.astype(np.float64), logits.astype(np.float64)
  log_p = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
  log_q = got - np.logaddexp.reduce(got, axis=-1, keepdims=True)
  kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)
  return float(np.max(np.abs(ref - got))), float(np.mean(kl))


def check(hf_dir: str, model_yml: str, params_dir: str, vocab_size: int) -> tuple[float, float]:
  """Runs both models, prints the one-line verdict, and raises a UserError above TOLERANCE."""
  require_torch()
  tokens = random_tokens(vocab_size)
  max_abs, kl = compare(hf_logits(hf_dir, tokens), maxtext_logits(model_yml, params_dir, tokens))
  print(f"logit check: max_abs_diff={max_abs:.3g} kl={kl:.3g}", flush=True)
  if not max_abs <= TOLERANCE:
    raise UserError(f"logit check failed: max_abs_diff={max_abs:.3g} exceeds {TOLERANCE:g}")
  return max_abs, kl
