"""opt_type=muon: which params get Muon (and as which matrix) and which AdamW, on the tiny llama scanned and
unrolled and on every family; one step against a numpy float64 Newton-Schulz reference per layer; with LoRA,
gradient accumulation and a resume; the loss falls."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.runtime import mesh
from MaxText.tests.helpers import LORA, run_train, tiny_config
from MaxText.tests.tiny_models import DEEPSEEK, FAMILIES, train_on_one_batch
from MaxText.training import muon, train_state, training_setup

MUON = ("opt_type=muon", "learning_rate=1e-2", "warmup_steps_fraction=0")
NS_COEFFS, NS_STEPS = (3.4445, -4.7750, 2.0315), 5  # optax.contrib.muon's defaults, which opt_type=muon keeps


def _setup(*args):
  config = tiny_config(*MUON, *args)
  device_mesh = mesh.create_device_mesh(config)
  return config, device_mesh, training_setup.build(config, device_mesh)


def _table(*args) -> dict:
  """{'/'-joined param path: (fan_in axes, fan_out axes), or 'adamw'}."""
  config, device_mesh, setup = _setup(*args)
  table = muon.dimension_table(train_state.logical_param_axes(setup.model, config, device_mesh))
  return {"/".join(k): (d.reduction_axis, d.output_axis) if d else "adamw" for k, d in table.items()}


def test_the_tiny_llama_scanned_gets_muon_on_each_layers_matrices_and_adamw_elsewhere():
  # Kernels (embed, layers, ...): the layers axis 1 is a batch axis; the query's matrix is (embed, heads x head_dim).
  assert _table() == {
    "decoder/decoder_norm/scale": "adamw",
    "decoder/layers/mlp/wi_0/kernel": ((0,), (2,)),
    "decoder/layers/mlp/wi_1/kernel": ((0,), (2,)),
    "decoder/layers/mlp/wo/kernel": ((0,), (2,)),
    "decoder/layers/post_self_attention_layer_norm/scale": "adamw",
    "decoder/layers/pre_self_attention_layer_norm/scale": "adamw",
    "decoder/layers/self_attention/key/kernel": ((0,), (2, 3)),
    "decoder/layers/self_attention/out/kernel": ((0, 2), (3,)),
    "decoder/layers/self_attention/query/kernel": ((0,), (2, 3)),
    "decoder/layers/self_attention/value/kernel": ((0,), (2, 3)),
    "decoder/logits_dense/kernel": "adamw",
    "token_embedder/embedding": "adamw",
  }


def test_the_tiny_llama_unrolled_gets_the_same_split_without_a_layers_axis():
  expected = {
    "decoder/decoder_norm/scale": "adamw",
    "decoder/logits_dense/kernel": "adamw",
    "token_embedder/embedding": "adamw",
  }
  for layer in ("layers_0", "layers_1"):
    prefix = f"decoder/{layer}"
    expected |= {
      f"{prefix}/mlp/wi_0/kernel": ((0,), (1,)),
      f"{prefix}/mlp/wi_1/kernel": ((0,), (1,)),
      f"{prefix}/mlp/wo/kernel": ((0,), (1,)),
      f"{prefix}/post_self_attention_layer_norm/scale": "adamw",
      f"{prefix}/pre_self_attention_layer_norm/scale": "adamw",
      f"{prefix}/self_attention/key/kernel": ((0,), (1, 2)),
      f"{prefix}/self_attention/out/kernel": ((0, 1), (2,)),
      f"{prefix}/self_attention/query/kernel": ((0,), (1, 2)),
      f"{prefix}/self_attention/value/kernel": ((0,), (1, 2)),
    }
  assert _table("scan_layers=false") == expected


def _fans(config, device_mesh, setup) -> dict:
  """{path: (fan_in, fan_out)} of the params that get Muon."""
  table = muon.dimension_table(train_state.logical_param_axes(setup.model, config, device_mesh))
  shapes = {"/".join(k): leaf.shape for k, leaf in _flat(setup.abstract_state.params)}
  fans = {}
  for keys, dims in table.items():
    if dims is not None:
      shape = shapes["/".join(keys)]
      fans["/".join(keys)] = tuple(int(np.prod([shape[a] for a in axes])) for axes in (dims[0], dims[1]))
  return fans


def _flat(tree):
  return [
    (tuple(str(getattr(p, "key", p)) for p in path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  ]


MOE = ["num_experts=4", "num_experts_per_tok=2"]
MODELS = {
  **{family: [f"decoder_block={family}", *args] for family, args in FAMILIES.items()},
  "mixtral": ["decoder_block=mixtral", *MOE],
  "qwen3_moe": ["decoder_block=qwen3_moe", *MOE],
  "fused": ["fused_mlp=true", "fused_qkv=true", "base_num_kv_heads=4"],  # a batch axis inside the kernel
}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_familys_kernels_get_muon_as_input_by_output_matrices(model):
  """The tiny dims: embed 32, 4 query heads of 8 (kv heads: 2, or 4 where the config says), mlp 64, 4 experts."""
  config, device_mesh, setup = _setup(*MODELS[model])
  fans = _fans(config, device_mesh, setup)
  kv = 8 * config.num_kv_heads
  expected = {"query": (32, 32), "key": (32, kv), "value": (32, kv), "qkv_proj": (32, 32), "out": (32, 32)}
  expected |= {"wi": (32, 64), "wi_0": (32, 64), "wi_1": (32, 64), "wo": (64, 32), "gate": (32, 4)}
  modules = set()
  for path, fan in fans.items():
    parts = path.split("/")
    module = parts[-2] if parts[-1] == "kernel" else parts[-1]  # MoE's experts: MoeBlock_0/wi_0
    assert fan == expected[module], (path, fan)
    modules.add(module)
  assert modules >= {"out", "wo"}, fans
  assert not any("embed" in p or "logits" in p or "norm" in p or p.endswith("bias") for p in fans), fans


def test_deepseeks_latent_attention_experts_and_router_with_lora_adapters():
  config, device_mesh, setup = _setup(*DEEPSEEK, "enable_lora=true", "lora_rank=4", "lora_module_path=.")
  fans = _fans(config, device_mesh, setup)
  moe, attention = "decoder/moe_layers/MoeBlock_0", "decoder/moe_layers/self_attention"
  # embed 32; q_lora 16, kv_lora 8 (+ rope 4); 4 heads of nope 8 + rope 4 (query), nope 8 + v 6 (kv); experts 8 x 16
  assert fans[f"{attention}/wq_a/lora_a"] == (32, 4)  # A: input -> rank
  assert fans[f"{attention}/wq_b/lora_b"] == (4, 48)  # B: rank -> output
  assert fans[f"{attention}/out/lora_a"] == (24, 4)
  assert fans[f"{moe}/wi_0"] == (32, 16)  # per expert and layer
  assert fans[f"{moe}/wo"] == (16, 32)
  assert fans[f"{moe}/gate/kernel"] == (32, 8)  # the router: embed -> experts
  # The optimizer holds the adapters alone (Muon's momenta of them): the base, experts and router too, is frozen.
  state_paths = {k for k, leaf in _flat(setup.abstract_state.opt_state) if leaf.ndim > 1}
  assert state_paths and all(k[-1] in ("lora_a", "lora_b") for k in state_paths), state_paths


def _newton_schulz(m: np.ndarray) -> np.ndarray:
  """optax's quintic Newton-Schulz orthogonalisation, in float64."""
  x = m / (np.linalg.norm(m) + 1e-8)
  transposed = x.shape[0] > x.shape[1]
  x = x.T if transposed else x
  a_, b_, c_ = NS_COEFFS
  for _ in range(NS_STEPS):
    a = x @ x.T
    x = a_ * x + (b_ * a + c_ * a @ a) @ x
  return x.T if transposed else x


@pytest.mark.parametrize("consistent_rms", [None, 0.2])
def test_one_step_equals_numpy_newton_schulz_per_layer_and_adamw_elsewhere(consistent_rms):
  config, device_mesh, setup = _setup(
    "gradient_clipping_threshold=0",
    "muon_weight_decay=0.3",
    "adam_weight_decay=0.2",
    f"muon_consistent_rms={consistent_rms or 'null'}",
  )
  state = setup.init_state(config, device_mesh)
  rng = np.random.default_rng(0)
  grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), state.params)
  updates, _ = jax.jit(setup.tx.update)(grads, state.opt_state, state.params)
  lr, beta, b1, b2, eps = config.learning_rate, config.muon_beta, config.adam_b1, config.adam_b2, config.adam_eps
  for path, (fan_in, fan_out) in (("query", (32, 32)), ("wo", (64, 32))):
    keys = ("self_attention", "query") if path == "query" else ("mlp", "wo")
    kernel = state.params["decoder"]["layers"][keys[0]][keys[1]]["kernel"]
    g = np.asarray(grads["decoder"]["layers"][keys[0]][keys[1]]["kernel"], np.float64)
    got = np.asarray(updates["decoder"]["layers"][keys[0]][keys[1]]["kernel"])
    for layer in range(config.num_decoder_layers):
      g_layer = np.take(g, layer, axis=config.param_scan_axis).reshape(fan_in, fan_out)  # (fan_in, fan_out)
      # Nesterov momentum at step 1: mu = (1 - beta) g, bias-corrected, blended with the corrected gradient.
      momentum = beta * (1 - beta) * g_layer / (1 - beta**2) + g_layer
      scale = np.sqrt(max(1, fan_out / fan_in)) if consistent_rms is None else np.sqrt(max(fan_in, fan_out)) * 0.2
      p_layer = np.take(np.asarray(kernel, np.float64), layer, axis=config.param_scan_axis).reshape(fan_in, fan_out)
      expected = -lr * (scale * _newton_schulz(momentum) + 0.3 * p_layer)
      got_layer = np.take(got, layer, axis=config.param_scan_axis).reshape(fan_in, fan_out)
      # float32 Newton-Schulz: about 2e-6 of the largest entry here
      np.testing.assert_allclose(got_layer, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
  # The embedding: optax's AdamW (Nesterov, as upstream's Muon) with the adam_* keys, first step.
  g = np.asarray(grads["token_embedder"]["embedding"], np.float64)
  p = np.asarray(state.params["token_embedder"]["embedding"], np.float64)
  mu_hat = b1 * (1 - b1) * g / (1 - b1**2) + g
  nu_hat = g * g
  expected = -lr * (mu_hat / (np.sqrt(nu_hat) + eps) + 0.2 * p)
  np.testing.assert_allclose(np.asarray(updates["token_embedder"]["embedding"]), expected, rtol=1e-5, atol=1e-7)
  del b2  # the first step's nu_hat is g^2 whatever adam_b2 is


def test_gradient_accumulation_makes_the_one_batch_update():
  whole, _ = train_on_one_batch(*MUON, "per_device_batch_size=2", steps=3)
  accumulated, _ = train_on_one_batch(*MUON, "per_device_batch_size=1", "gradient_accumulation_steps=2", steps=3)
  np.testing.assert_allclose(accumulated, whole, rtol=1e-5)


def test_lora_trains_the_adapters_with_muon_and_leaves_the_base():
  losses, state = train_on_one_batch(*MUON, *LORA, steps=5)
  config, device_mesh, setup = _setup(*LORA)
  start = setup.init_state(config, device_mesh)
  for (keys, old), (_, new) in zip(_flat(start.params), _flat(state.params)):
    assert (keys[-1] in ("lora_a", "lora_b")) == (not np.array_equal(np.asarray(old), np.asarray(new))), keys
  assert losses[-1] < losses[0]


def test_a_resumed_run_continues_with_the_same_losses(tmp_path):
  args = (*MUON, "checkpoint_period=3", "learning_rate_schedule_steps=8")
  _, whole = run_train(tmp_path, "whole", *args, "steps=8")
  first, _ = run_train(tmp_path, "resumed", *args, "steps=5")
  assert first.returncode == 0, first.stderr[-2000:]
  second, resumed = run_train(tmp_path, "resumed", *args, "steps=8")
  assert second.returncode == 0 and "Restored the checkpoint of step 4" in second.stdout, second.stderr[-2000:]
  assert [m["learning/loss"] for m in resumed] == [m["learning/loss"] for m in whole]


def test_the_loss_falls_over_50_steps():
  losses, _ = train_on_one_batch(*MUON, steps=50)
  assert losses[-1] < 0.2 * losses[0], losses
