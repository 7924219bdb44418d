"""Keys of base.yml's Model section: the architecture, its dims, precision, attention kernel and remat policy."""

from MaxText.configuration.common_types import (
  ATTENTION_KERNELS,
  DECODER_BLOCKS,
  DTYPES,
  FP8_SCALINGS,
  KV_QUANT_AXES,
  KV_QUANT_DTYPES,
  MLP_ACTIVATIONS,
  QUANTIZATIONS,
  REMAT_NAMES,
  REMAT_PLACEMENTS,
  REMAT_POLICIES,
)
from MaxText.configuration.config_keys import NON_NEGATIVE, POSITIVE, Key, On, Range

_FP8 = On("quantization", "fp8")
_KV_CACHE = On("quantize_kvcache", True)
_MOE = On("decoder_block", "mixtral", "qwen3_moe", "deepseek", "llama4", "gpt_oss")  # the blocks with experts
_DEEPSEEK = On("decoder_block", "deepseek")
_SHARED_EXPERTS = On("decoder_block", "deepseek", "llama4")
_LLAMA4 = On("decoder_block", "llama4")
_GPT_OSS = On("decoder_block", "gpt_oss")
_YARN = On("rope_type", "yarn")

_TILE = Range(1, also=(-1,), says="-1 (from the shapes) or a positive tile size")
_MEGABLOX = On("megablox", True)
_PASS = {"fwd": "forward", "dlhs": "input gradient", "drhs": "weight gradient"}
_DIM = {"batch_seq": "rows", "embed_dim": "embed dim", "mlp_dim": "mlp dim"}
# Upstream's tiles of megablox's kernels, per weight (wi, wo), pass and dim; -1: tile_<dim>, else from the shapes.
_GMM_TILES = {
  f"{weight}_tile_{p}_{dim}": Key(
    f"megablox: the {_DIM[dim]} tile of {weight}'s {_PASS[p]} grouped matmul; -1: tile_{dim}, else from the shapes.",
    range=_TILE,
    acts_with=_MEGABLOX,
  )
  for weight in ("wi", "wo")
  for p in _PASS
  for dim in _DIM
} | {
  f"tile_{dim}": Key(
    f"megablox: the {_DIM[dim]} tile of every grouped matmul whose own key is -1; -1: from the shapes.",
    range=_TILE,
    acts_with=_MEGABLOX,
  )
  for dim in _DIM
}

SECTIONS = {
  "Model": {
    "decoder_block": Key(
      "The decoder layer's family (--help lists them); default: parallel attention + MLP; llama2: Llama 2 and 3.",
      choices=DECODER_BLOCKS,
    ),
    "weight_dtype": Key("Parameter storage dtype.", choices=DTYPES),
    "dtype": Key("Activation (compute) dtype.", choices=DTYPES),
    # Low precision
    "quantization": Key(
      "Low-precision GEMMs of the decoder layers: int8 | int8w, int4w (kernels) | intmp (quant_cfg_path) | fp8; empty: off.",
      choices=QUANTIZATIONS,
    ),
    "fp8_scaling": Key(
      "delayed (from the amax history) | current (each tensor's own amax).", choices=FP8_SCALINGS, acts_with=_FP8
    ),
    "fp8_amax_history_length": Key("Steps of amax history behind a delayed scale.", range=POSITIVE, acts_with=_FP8),
    "quantize_kvcache": Key("int8 KV cache for decoding (a scale per kv_quant_axis)."),
    "kv_quant_axis": Key(
      "quantize_kvcache: a scale per token (heads_and_dkv) or per token and head (dkv).",
      choices=KV_QUANT_AXES,
      acts_with=_KV_CACHE,
    ),
    "kv_quant_dtype": Key("quantize_kvcache: the dtype of the cache.", choices=KV_QUANT_DTYPES, acts_with=_KV_CACHE),
    # Dims
    "global_parameter_scale": Key(
      "A power of 2 that multiplies the base_* dims: heads and mlp, then emb, then layers grow in turn.",
      # The range refuses what is below 1; config_validation refuses the rest that is not a power of 2.
      range=Range(1, says="a power of 2 (1, 2, 4, 8, ...)"),
    ),
    "base_emb_dim": Key("Embedding (model) width, before global_parameter_scale.", range=POSITIVE),
    "base_num_query_heads": Key("Query heads; a multiple of base_num_kv_heads.", range=POSITIVE),
    "base_num_kv_heads": Key("Key/value heads (grouped-query attention when fewer than query heads).", range=POSITIVE),
    "base_mlp_dim": Key("MLP hidden width.", range=POSITIVE),
    "base_num_decoder_layers": Key(
      "Decoder layers; a multiple of the layers of one scanned block (gemma2: 2).", range=POSITIVE
    ),
    "head_dim": Key("Width of one attention head; even (rotary embeddings rotate pairs).", range=POSITIVE),
    "mlp_activations": Key(
      "Gated MLP: the product of these activations of separate projections, e.g. [silu, linear].",
      choices=MLP_ACTIVATIONS,
    ),
    # Mixture of experts
    "num_experts": Key(
      "Experts (gated MLPs) per MoE layer (decoder_block mixtral, qwen3_moe).", range=POSITIVE, acts_with=_MOE
    ),
    "num_experts_per_tok": Key("Experts each token goes to (top-k); at most num_experts.", range=POSITIVE, acts_with=_MOE),
    "capacity_factor": Key(
      "<= 0: dropless; > 0: an expert takes at most int(length x k / experts x this) tokens a sequence, drops the rest.",
      range=Range(says="a number (<= 0: dropless; > 0: tokens per expert x that factor)"),
      acts_with=_MOE,
    ),
    "moe_dispatch": Key(
      "Grouped experts: gather (each device gathers all weights) | all_to_all (tokens go to their experts' devices).",
      choices=("gather", "all_to_all"),
      acts_with=_MOE,
    ),
    "sparse_matmul": Key(
      "Experts as grouped matmuls over the routed tokens (true) or dense einsums over every expert (docs/models.md).",
      acts_with=_MOE,
    ),
    "megablox": Key(
      "Grouped matmuls: megablox's Pallas kernels on TPU, padded tiles on GPU, ragged_dot on CPU; false: ragged_dot."
    ),
    **_GMM_TILES,
    "load_balance_loss_weight": Key(
      "Weight of the router's load-balancing loss in the training loss (not in eval loss).",
      range=NON_NEGATIVE,
      acts_with=_MOE,
    ),
    "first_num_dense_layers": Key(
      "deepseek: the first layers, with a dense MLP (base_mlp_dim); the rest have experts.",
      range=Range(0),
      acts_with=_DEEPSEEK,
    ),
    "base_moe_mlp_dim": Key("deepseek, llama4: each expert's MLP width.", range=POSITIVE, acts_with=_SHARED_EXPERTS),
    "shared_experts": Key(
      "deepseek, llama4: experts that every token goes to (one MLP of shared x base_moe_mlp_dim); 0: none.",
      range=Range(0),
      acts_with=_SHARED_EXPERTS,
    ),
    "n_routing_groups": Key(
      "deepseek: groups of experts (a divisor of num_experts); a token searches its best topk_routing_group.",
      range=POSITIVE,
      acts_with=_DEEPSEEK,
    ),
    "topk_routing_group": Key(
      "deepseek: groups (by their 2 best scores) a token chooses its experts from.", range=POSITIVE, acts_with=_DEEPSEEK
    ),
    "routed_scaling_factor": Key("deepseek: multiplies the routed experts' weights.", range=POSITIVE, acts_with=_DEEPSEEK),
    "routed_bias": Key(
      "Per-expert router bias. deepseek: only picks experts, moved to equal loads, untrained; gpt_oss: in logits, trained.",
      acts_with=On("decoder_block", "deepseek", "gpt_oss"),
    ),
    "routed_bias_update_rate": Key(
      "deepseek, routed_bias: the bias moves by this after each step (up if underloaded, down if over).",
      range=NON_NEGATIVE,
      acts_with=_DEEPSEEK,
    ),
    "interleave_moe_layer_step": Key(
      "llama4: every this-th layer has experts (1: all; 2: dense and MoE alternate); 1, 2 or 4.",
      choices=(1, 2, 4),
      acts_with=_LLAMA4,
    ),
    "nope_layer_interval": Key(
      "llama4: every this-th layer has no RoPE (NoPE), and attends globally; -1: none; 1, 2 or 4.",
      choices=(-1, 1, 2, 4),
      acts_with=_LLAMA4,
    ),
    "chunk_attn_window_size": Key(
      "llama4: the RoPE layers attend within chunks of this many tokens (chunked local attention); 0: off.",
      range=Range(0),
      acts_with=_LLAMA4,
    ),
    "use_qk_norm": Key("llama4: L2-normalise each query and key head after RoPE (on the RoPE layers).", acts_with=_LLAMA4),
    "temperature_tuning": Key(
      "llama4: scale the NoPE layers' queries by 1 + scale x log(1 + floor((position + 1) / floor_scale)).",
      acts_with=_LLAMA4,
    ),
    "temperature_tuning_scale": Key(
      "llama4, temperature_tuning: the scale (transformers' attn_scale).",
      range=NON_NEGATIVE,
      acts_with=On("temperature_tuning", True),
    ),
    "temperature_tuning_floor_scale": Key(
      "llama4, temperature_tuning: positions per step of the log (transformers' floor_scale).",
      range=POSITIVE,
      acts_with=On("temperature_tuning", True),
    ),
    "mlp_bias": Key("gpt_oss: the experts' wi_0, wi_1 and wo have trained biases.", acts_with=_GPT_OSS),
    "mlp_activations_limit": Key(
      "gpt_oss: the experts' SwiGLU clamps the gate above and the up projection to +-this (7.0); <= 0: no clamp.",
      range=Range(says="a number (<= 0: no clamp)"),
      acts_with=_GPT_OSS,
    ),
    "attention_sink": Key(
      "gpt_oss: a learned logit per query head joins each softmax (self_attention/sinks); kernels dot_product, flash.",
      acts_with=_GPT_OSS,
    ),
    "mtp_num_layers": Key(
      "Multi-token prediction depths (one decoder layer each; depth k predicts the token k + 1 ahead); 0: none.",
      range=Range(0),
    ),
    "mtp_loss_scaling_factor": Key(
      "Weight of the depths' mean cross-entropy in the training loss (DeepSeek-V3: 0.3, then 0.1).",
      range=NON_NEGATIVE,
    ),
    "q_lora_rank": Key(
      "deepseek: the query's low-rank bottleneck; 0: projected directly.", range=Range(0), acts_with=_DEEPSEEK
    ),
    "kv_lora_rank": Key(
      "deepseek: the key/value latent's width (what the KV cache holds).", range=POSITIVE, acts_with=_DEEPSEEK
    ),
    "qk_nope_head_dim": Key("deepseek: the part of each query/key head without RoPE.", range=POSITIVE, acts_with=_DEEPSEEK),
    "qk_rope_head_dim": Key(
      "deepseek: the part of each query/key head with RoPE; even.", range=POSITIVE, acts_with=_DEEPSEEK
    ),
    "v_head_dim": Key("deepseek: each value head's width.", range=POSITIVE, acts_with=_DEEPSEEK),
    "dropout_rate": Key(
      "Dropout rate of the decoder layers.", range=Range(0, 1, high_open=True), acts_with=On("enable_dropout", True)
    ),
    "enable_dropout": Key("Apply dropout in training steps (never in eval)."),
    # Embeddings and logits
    "logits_via_embedding": Key("Tie the output projection to the token embedding."),
    "normalize_embedding_logits": Key("With tied logits, divide them by sqrt(emb_dim)."),
    "final_logits_soft_cap": Key("> 0: logits = cap * tanh(logits / cap) (Gemma 2: 30); 0 disables.", range=NON_NEGATIVE),
    "use_iota_embed": Key("Look embeddings up by a one-hot matmul instead of a gather (faster on TPU; same values)."),
    "trainable_position_size": Key(
      "> 0: add learned position embeddings, a table of this many positions (GPT-3); -1: none.",
      # The range refuses 0 and below -1; config_validation refuses what is below max_target_length.
      range=Range(1, also=(-1,), says="-1 (no learned positions) or at least max_target_length"),
    ),
    "logits_dot_in_fp32": Key("Compute the output logits in float32 whatever dtype is."),
    "vocab_size": Key("Rows of the embedding and columns of the logits; at least the tokenizer's size.", range=POSITIVE),
    "normalization_layer_epsilon": Key("Epsilon of the normalization layers.", range=Range(0, low_open=True)),
    # Positions and attention
    "rope_min_timescale": Key("Shortest RoPE timescale; at most rope_max_timescale.", range=POSITIVE),
    "rope_max_timescale": Key("Longest RoPE timescale (the RoPE theta).", range=POSITIVE),
    "query_pre_attn_scalar": Key(
      "Attention logits are (q . k) * this**-0.5; 0: head_dim (the usual 1/sqrt(head_dim)).", range=NON_NEGATIVE
    ),
    "rope_scaling_factor": Key(
      "> 0: Llama 3.1 RoPE scaling (transformers' rope_type llama3) by this factor.", range=NON_NEGATIVE
    ),
    "rope_scaling_low_freq_factor": Key("Llama 3.1 RoPE scaling: low_freq_factor; 0 < low < high."),
    "rope_scaling_high_freq_factor": Key("Llama 3.1 RoPE scaling: high_freq_factor."),
    "rope_scaling_original_max_position_embeddings": Key(
      "Llama 3.1 RoPE scaling: the context length of the original model.", range=POSITIVE
    ),
    "rope_linear_scaling_factor": Key(
      "Linear RoPE scaling (transformers' rope_type linear): frequencies / factor; 1: off (Gemma 3: its global layers).",
      range=POSITIVE,
    ),
    "local_rope_max_timescale": Key(
      "Gemma 3's local (sliding-window) layers: their RoPE base; -1: rope_max_timescale.",
      range=Range(0, low_open=True, also=(-1,), says="-1 (rope_max_timescale) or a positive RoPE base"),
      acts_with=On("decoder_block", "gemma3"),
    ),
    "rope_type": Key(
      "default | yarn (YaRN RoPE scaling: deepseek's latent attention, truncated; gpt_oss's, not truncated).",
      choices=("default", "yarn"),
    ),
    "rope_factor": Key("YaRN: the context extension factor.", range=Range(1), acts_with=_YARN),
    "original_max_position_embeddings": Key("YaRN: the original model's context length.", range=POSITIVE, acts_with=_YARN),
    "beta_fast": Key("YaRN: wavelengths fitting more often than this are kept.", range=POSITIVE, acts_with=_YARN),
    "beta_slow": Key(
      "YaRN: wavelengths fitting less often than this are divided by rope_factor.", range=POSITIVE, acts_with=_YARN
    ),
    "mscale": Key("YaRN: logits grow by (0.1 * mscale * ln(rope_factor) + 1)^2.", range=NON_NEGATIVE, acts_with=_YARN),
    "sliding_window_size": Key(
      "> 0: a query sees only itself and the size - 1 keys before it (Mistral, Gemma 2 and 3 local layers).",
      range=Range(0, says=">= 0 (0: no window)"),
    ),
    "attn_logits_soft_cap": Key(
      "> 0: attention logits = cap * tanh(logits / cap) before masking (Gemma 2: 50); 0 disables.", range=NON_NEGATIVE
    ),
    "use_post_attn_norm": Key("Gemma 2 and 3: normalize the attention output before the residual add."),
    "use_post_ffw_norm": Key("Gemma 2 and 3: normalize the MLP output before the residual add."),
    "fused_qkv": Key("One query/key/value kernel qkv_proj [E, 3, heads, head_dim]; needs as many kv heads as query heads."),
    "fused_mlp": Key("The gated MLP's wi_0, wi_1, ... as one kernel wi [E, num_activations, mlp]."),
    "attention": Key(
      "Attention kernel; autoselected: flash on TPU, cudnn_flash_jax on GPU where it can run, else dot_product.",
      choices=ATTENTION_KERNELS,
    ),
    # Layers and remat
    "scan_layers": Key("Scan over stacked layer params (fast compile); false unrolls layers_0 .. layers_{L-1}."),
    "param_scan_axis": Key("The axis of scanned params that stacks the layers.", choices=(0, 1)),
    "remat_policy": Key(
      "What the backward pass keeps instead of recomputing: full keeps nothing, none everything (base.yml lists all).",
      choices=REMAT_POLICIES,
    ),
    **{
      name: Key(
        f"remat_policy=custom: {name} is recomputed (remat), kept on the device, or offloaded to host memory.",
        choices=REMAT_PLACEMENTS,
        acts_with=On("remat_policy", "custom"),
      )
      for name in REMAT_NAMES
    },
  },
}
