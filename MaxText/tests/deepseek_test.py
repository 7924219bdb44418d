"""DeepSeek-V3 (decoder_block=deepseek) as a whole model: its two stacks in both layouts, the routing bias kept out of
the optimizer and moved by its own rule, the balance loss's weight, flops, and the config's checks.
(Its logits against transformers' DeepseekV3ForCausalLM: convert_checkpoint_test; MLA: mla_test; the MoE:
deepseek_moe_test.)"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.checkpoints import layer_stacking, params_layout
from MaxText.errors import ConfigError
from MaxText.features import losses, selection
from MaxText.layers import layer_names, models, moe
from MaxText.layers.multi_token_prediction import MTP_LOGITS
from MaxText.runtime import mesh
from MaxText.tests.helpers import tiny_config
from MaxText.tests.tiny_models import DEEPSEEK
from MaxText.training import flops, train_step, training_setup

LENGTH = 16


def _batch(config, seed=0):
  rows = config.global_batch_size_to_load
  tokens = jax.random.randint(jax.random.PRNGKey(seed), (rows, LENGTH), 0, config.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(LENGTH), tokens.shape)
  ones = jnp.ones_like(tokens)
  return dict(
    inputs=tokens,
    inputs_position=positions,
    inputs_segmentation=ones,
    targets=jnp.roll(tokens, -1, axis=1),
    targets_position=positions,
    targets_segmentation=ones,
  )


def _state(config):
  device_mesh = mesh.create_device_mesh(config)
  setup = training_setup.build(config, device_mesh)
  state = setup.init_state(config, device_mesh)
  return setup, state


def _bias(params):
  return np.asarray(params["decoder"]["moe_layers"]["MoeBlock_0"]["gate"]["bias"])


def test_the_two_stacks_scanned_equal_unrolled():
  config = tiny_config(*DEEPSEEK, "scan_layers=true")
  assert models.layer_stacks(config) == {"dense_layers": 1, "moe_layers": 2}
  batch = _batch(config)
  model = models.Transformer(config)
  params = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), batch["inputs"], batch["inputs_position"]))["params"]
  scanned = model.apply({"params": params}, batch["inputs"], batch["inputs_position"])
  unrolled_params = dict(params, decoder=layer_stacking.unstack_all(params["decoder"], models.layer_stacks(config), 1))
  assert {"dense_layers_0", "moe_layers_0", "moe_layers_1"} <= set(unrolled_params["decoder"])
  unrolled = models.Transformer(tiny_config(*DEEPSEEK, "scan_layers=false")).apply(
    {"params": unrolled_params}, batch["inputs"], batch["inputs_position"]
  )
  np.testing.assert_allclose(np.asarray(scanned), np.asarray(unrolled), rtol=1e-5, atol=1e-5)
  # load_parameters_path's relayout: a per-layer checkpoint restores into a scanned run
  abstract = jax.eval_shape(lambda: params)
  shardings = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings), abstract)
  restacked = params_layout.to_run_layout(unrolled_params, abstract, 1)
  jax.tree.map(np.testing.assert_array_equal, restacked, params)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_routing_bias_moves_by_its_rule_and_not_by_the_optimizer(accumulation):
  config = tiny_config(
    *DEEPSEEK,
    "routed_bias=true",
    "routed_bias_update_rate=0.01",
    f"gradient_accumulation_steps={accumulation}",
    "adam_weight_decay=0.5",
    "learning_rate=0.1",
    "warmup_steps_fraction=0",
  )
  setup, state = _state(config)
  step = jax.jit(functools.partial(train_step.train_step, setup.model, config, setup.features))
  new_state, _ = step(state, _batch(config))
  moved = _bias(new_state.params) - _bias(state.params)  # (E, L): layers stacked on param_scan_axis 1
  # each expert up or down by the rate (0 at exactly the mean load), and nothing else (no decay, no gradient step)
  np.testing.assert_allclose(np.abs(moved)[np.abs(moved) > 1e-4], 0.01, atol=1e-7)
  assert (moved > 0).sum() >= 4 and (moved < 0).sum() >= 4 and (np.abs(moved) < 1e-9).sum() <= 4
  assert not np.allclose(new_state.params["decoder"]["moe_layers"]["MoeBlock_0"]["gate"]["kernel"], 0)


def test_without_routed_bias_a_converted_bias_stays_as_it_is():
  """AdamW's weight decay would shrink it (its gradient is zero): the optimizer must leave it alone."""
  config = tiny_config(
    *DEEPSEEK, "routed_bias=false", "adam_weight_decay=0.5", "learning_rate=0.1", "warmup_steps_fraction=0"
  )
  setup, state = _state(config)
  bias = state.params["decoder"]["moe_layers"]["MoeBlock_0"]["gate"]["bias"]
  params = jax.tree.map(lambda x: x, state.params)
  params["decoder"]["moe_layers"]["MoeBlock_0"]["gate"]["bias"] = bias + 0.3
  state = state.replace(params=params)
  new_state, _ = jax.jit(functools.partial(train_step.train_step, setup.model, config, setup.features))(
    state, _batch(config)
  )
  np.testing.assert_array_equal(_bias(new_state.params), _bias(state.params))


def test_the_sequence_balance_loss_follows_its_weight():
  batch = _batch(tiny_config(*DEEPSEEK))
  losses = {}
  for weight in (0.0, 0.5):
    config = tiny_config(*DEEPSEEK, f"load_balance_loss_weight={weight}")
    setup, state = _state(config)
    loss, aux = train_step.loss_fn(
      setup.model, config, selection.for_config(config), state.params, batch, jax.random.PRNGKey(0), train=True
    )
    sequence_wise = float(moe.sequence_balance_loss(aux.sown, 8, 2))  # DeepSeek-V3's, not Switch/Mixtral's
    losses[weight] = (float(loss), float(aux.terms["moe_lb_loss"]), float(aux.weights), sequence_wise)
  plain, with_balance = losses[0.0], losses[0.5]
  assert plain[1] == 0.0
  assert 1.0 <= with_balance[3] <= 4.0  # 1 at perfect balance, E/k at the worst
  assert with_balance[1] == pytest.approx(0.5 * with_balance[3] * with_balance[2], rel=1e-6)
  assert with_balance[0] == pytest.approx(plain[0] + with_balance[1], rel=1e-6)


def test_flops_count_latent_attention_and_the_active_experts():
  config = tiny_config(*DEEPSEEK, "per_device_batch_size=1", f"max_target_length={LENGTH}")
  emb, heads, vocab, t = config.emb_dim, config.num_query_heads, config.vocab_size, LENGTH
  attention = emb * 16 + 16 * heads * 12 + emb * (8 + 4) + 8 * heads * (8 + 6) + heads * 6 * emb
  dense_mlp, experts = 3 * emb * config.mlp_dim, (2 + 1) * 3 * emb * 16 + emb * 8  # k + shared experts, router
  weights = 3 * attention + dense_mlp + 2 * experts + emb * vocab
  step = flops.training_tflops_per_device(config)
  assert step.learnable_tflops * 1e12 == pytest.approx(6 * weights * t, rel=1e-9)
  assert step.attention_tflops * 1e12 == pytest.approx(3 * 3 * 2 * t * t * heads * (12 + 6) / 2, rel=1e-9)


@pytest.mark.parametrize(
  "args,message",
  [
    (["n_routing_groups=3"], "n_routing_groups=3 must divide num_experts=8"),
    (["topk_routing_group=5"], "topk_routing_group=5 must not exceed n_routing_groups=4"),
    (["num_experts_per_tok=5", "topk_routing_group=2"], "num_experts_per_tok=5 exceeds the experts of"),
    (["first_num_dense_layers=4"], "first_num_dense_layers=4 must not exceed base_num_decoder_layers=3"),
    (["quantize_kvcache=true"], "quantize_kvcache=True is not supported with decoder_block=deepseek"),
    (["sliding_window_size=8"], "sliding_window_size=8 is not supported with decoder_block=deepseek"),
    (["decoder_block=llama2"], "rope_type=yarn is for multi-head latent attention (decoder_block=deepseek)"),
  ],
)
def test_config_mistakes_are_one_line(args, message):
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    tiny_config(*DEEPSEEK, *args)


@pytest.mark.parametrize("scan", ["true", "false"])
def test_both_stacks_layers_are_named_in_model_order_and_quantized(scan):
  """decoder/moe_layers' blocks follow decoder/dense_layers' in the layer names (numerics statistics, quant_cfg_path,
  the non-finite report), and fp8 quantizes the dense layers of both stacks."""
  config = tiny_config(*DEEPSEEK, "quantization=fp8", f"scan_layers={scan}")
  model = training_setup.create_model(config)
  batch = _batch(config)
  variables = jax.eval_shape(model.init, jax.random.PRNGKey(0), batch["inputs"], batch["inputs_position"])
  names = {layer.name for layer in layer_names.dense_layers(nn.unbox(variables["params"]), config)}
  assert {layer_names.layer_number(name) for name in names} == {1, 2, 3, None}  # None: the logits, outside the layers
  assert "decoder.layers.2.MoeBlock_0.shared_experts.wo" in names and "decoder.layers.0.mlp.wo" in names
  scales = variables["fp8_meta"]["decoder"]
  stacks = {"dense_layers", "moe_layers"} if scan == "true" else {"dense_layers_0", "moe_layers_0", "moe_layers_1"}
  assert set(scales) == stacks, set(scales)
  last = scales["moe_layers" if scan == "true" else "moe_layers_1"]
  assert "out" in last["self_attention"] and "wo" in last["MoeBlock_0"]["shared_experts"]  # the shared experts too


# ----------------------------------------------------------------------------- multi-token prediction


def test_mtp_loss_counts_the_token_k_ahead_within_a_document():
  """Position i of depth k is scored on targets[i + k], where that target is real, in i's document and inside."""
  targets = jnp.array([[10, 11, 12, 13, 14, 15]])
  segments = jnp.array([[1, 1, 1, 2, 2, 0]])  # two documents, then padding
  batch = {"targets": targets, "targets_segmentation": segments, "inputs_segmentation": segments}
  vocab = 20

  def sown(logits):
    return {"intermediates": {"decoder": {MTP_LOGITS: (logits,)}}}

  right = 50.0 * jax.nn.one_hot(jnp.roll(targets, -1, axis=1), vocab)  # sure of targets[i + 1]
  assert float(losses.mtp_loss(sown(right), batch)) < 1e-6
  wrong_where_counted = right.at[0, jnp.array([0, 1, 3])].set(0.0)  # i = 0, 1 (document 1) and 3 (document 2)
  uniform = float(np.log(vocab))
  assert float(losses.mtp_loss(sown(wrong_where_counted), batch)) == pytest.approx(uniform, rel=1e-5)
  # positions 2 (its target is in document 2), 4 (padding ahead) and 5 (past the end) are not counted
  ignored = right.at[0, jnp.array([2, 4, 5])].set(0.0)
  assert float(losses.mtp_loss(sown(ignored), batch)) < 1e-6


def test_mtp_depth_sees_no_token_past_the_one_it_is_given():
  """Depth 1 at position i sees tokens up to i + 1 (its input): changing token i + 2 leaves positions <= i alone."""
  config = tiny_config(*DEEPSEEK, "mtp_num_layers=1")
  batch = _batch(config)
  model = models.Transformer(config)
  params = jax.jit(model.init)(jax.random.PRNGKey(0), batch["inputs"], batch["inputs_position"])

  def mtp_logits(tokens):
    _, sown = model.apply(params, tokens, batch["inputs_position"], mutable=["intermediates"])
    return np.asarray(sown["intermediates"]["decoder"][MTP_LOGITS][0])

  before = mtp_logits(batch["inputs"])
  after = mtp_logits(batch["inputs"].at[:, 9].set((batch["inputs"][:, 9] + 1) % config.vocab_size))
  np.testing.assert_array_equal(after[:, :8], before[:, :8])
  assert not np.allclose(after[:, 8], before[:, 8])


@pytest.mark.slow  # 18 s: the gradient's compile
def test_mtp_weight_zero_gives_the_plain_loss_and_no_gradient_to_the_depths():
  config = tiny_config(*DEEPSEEK, "mtp_num_layers=1", "mtp_loss_scaling_factor=0", "load_balance_loss_weight=0")
  setup, state = _state(config)
  batch = _batch(config)
  loss, aux = train_step.loss_fn(
    setup.model, config, selection.for_config(config), state.params, batch, jax.random.PRNGKey(0), train=True
  )
  plain, _ = train_step.loss_fn(
    setup.model, config, selection.for_config(config), state.params, batch, jax.random.PRNGKey(0), train=False
  )
  assert float(loss) == pytest.approx(float(plain), rel=1e-6) and float(aux.terms["mtp_loss"]) == 0.0
  grads = jax.grad(
    lambda p: train_step.loss_fn(setup.model, config, selection.for_config(config), p, batch, jax.random.PRNGKey(0), True)[0]
  )(state.params)
  assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(grads["decoder"]["mtp_1"]))


def test_mtp_flops_add_a_layer_its_projection_and_logits():
  args = (*DEEPSEEK, "per_device_batch_size=1", f"max_target_length={LENGTH}")
  plain, with_mtp = (flops.training_tflops_per_device(tiny_config(*args, f"mtp_num_layers={d}")) for d in (0, 2))
  config = tiny_config(*args)
  emb, heads, t = config.emb_dim, config.num_query_heads, LENGTH
  attention = emb * 16 + 16 * heads * 12 + emb * (8 + 4) + 8 * heads * (8 + 6) + heads * 6 * emb
  moe_layer = attention + (2 + 1) * 3 * emb * 16 + emb * 8
  depth = 2 * emb * emb + moe_layer + emb * config.vocab_size
  assert (with_mtp.learnable_tflops - plain.learnable_tflops) * 1e12 == pytest.approx(6 * 2 * depth * t, rel=1e-9)


def test_the_latent_cache_is_smaller_than_a_full_kv_cache_by_the_expected_ratio():
  """Per token and layer MLA caches kv_lora_rank + qk_rope_head_dim numbers; keys and values of every head would be
  heads x (qk_nope + qk_rope + v): 12 against 4 x 18 here (576 against 40,960 for DeepSeek-V3, 1/71)."""
  config = tiny_config(*DEEPSEEK, "scan_layers=false")
  batch = _batch(config)
  model = models.Transformer(config)
  params = jax.jit(model.init)(jax.random.PRNGKey(0), batch["inputs"], batch["inputs_position"])["params"]
  _, state = model.apply({"params": params}, batch["inputs"], batch["inputs_position"], mutable=["cache"])
  per_token = sum(x.size for x in jax.tree.leaves(state["cache"])) / (batch["inputs"].shape[0] * config.max_target_length)
  layers, heads = config.num_decoder_layers, config.num_query_heads
  assert per_token == layers * (8 + 4)
  full = layers * heads * (8 + 4 + 6)
  assert per_token / full == pytest.approx(1 / 6)


def test_a_checkpoint_with_mtp_depths_names_the_key_a_run_without_them_needs():
  from MaxText.checkpoints import checkpointing  # pylint: disable=import-outside-toplevel

  shape = jax.ShapeDtypeStruct((4,), jnp.float32)
  saved = {"decoder": {"decoder_norm": {"scale": shape}, "mtp_1": {"norm": {"scale": shape}}}}
  wanted = {"decoder": {"decoder_norm": {"scale": shape}}}
  with pytest.raises(checkpointing.UserError, match=r"multi-token prediction depths: set mtp_num_layers=1\)"):
    checkpointing.check_checkpoint_fits(saved, wanted, "run/checkpoints/4")


def test_latent_attention_kernels_are_sharded_like_embed():
  """q_lora and kv_lora (the low-rank dims) have rules: no MLA kernel is left whole on every fsdp device."""
  config = tiny_config(*DEEPSEEK)
  batch = _batch(config)
  boxed = jax.eval_shape(models.Transformer(config).init, jax.random.PRNGKey(0), batch["inputs"], batch["inputs_position"])
  attention = nn.get_partition_spec(boxed)["params"]["decoder"]["moe_layers"]["self_attention"]
  for name in ("wq_a", "wq_b", "wkv_a", "wkv_b", "out"):
    spec = nn.logical_to_mesh_axes(attention[name]["kernel"], config.logical_axis_rules)
    axes = [a for part in spec if part for a in (part if isinstance(part, tuple) else (part,))]
    assert "fsdp" in axes, (name, spec)
