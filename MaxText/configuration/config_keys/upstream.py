"""Keys of upstream MaxText's base.yml (mid 2024) that run differently here or not at all.

Each is accepted at upstream's default, so that upstream's configs and scripts load; `refused` is the one line that
a user who sets another value reads: why it does not apply here, and what to use instead.
"""

from MaxText.configuration.config_keys import NON_NEGATIVE, POSITIVE, Key, On, Range

_CACHE_LAYOUT = (
  "the attention and KV cache layouts are fixed here (batch, sequence, heads, head_dim); their sharding follows "
  "logical_axis_rules"
)
_JETSTREAM = "is for JetStream serving (MaxEngine), which this project does not ship; decode.py generates from a checkpoint"


_GOODPUT = On("enable_goodput_recording", True)
_EMERGENCY = On("enable_emergency_checkpoint", True)


SECTIONS = {
  "Upstream MaxText keys": {
    "use_untrainable_positional_embedding": Key(
      "Upstream's sinusoidal positions; not implemented.",
      refused="sinusoidal positions are not implemented; positions come from RoPE, or from a learned table "
      "(trainable_position_size)",
    ),
    "record_internal_nn_metrics": Key(
      "Upstream's per-layer activation statistics; see numerics_debug_config.",
      refused="use numerics_debug_config: its statistics (mean, std, norms, amax, ...) of every dense layer's "
      "activations, weights and gradients (docs/diagnostics.md)",
    ),
    "attention_type": Key(
      "Upstream's per-layer attention kind; sliding windows: sliding_window_size; mla: decoder_block=deepseek.",
      refused="sliding windows are set by sliding_window_size (Mistral, Gemma 2 and 3's local layers), and "
      "attention_type=mla goes with decoder_block=deepseek",
    ),
    "prefill_cache_axis_order": Key("Upstream's KV cache layout for prefill; fixed here.", refused=_CACHE_LAYOUT),
    "ar_cache_axis_order": Key("Upstream's KV cache layout for decoding; fixed here.", refused=_CACHE_LAYOUT),
    "compute_axis_order": Key("Upstream's attention compute layout; fixed here.", refused=_CACHE_LAYOUT),
    "reshape_q": Key("Upstream's query reshape for decoding; not needed here.", refused=_CACHE_LAYOUT),
    "num_slices": Key(
      "The slices (DCN-connected groups of devices): -1 detects them; another value must match the devices.",
      range=Range(1, also=(-1,), says="-1 (detected) or a positive number of slices"),
    ),
    "enable_single_controller": Key(
      "Upstream's Pathways (single-controller JAX); not available outside Google Cloud.",
      refused="it is for Pathways (single-controller JAX), which is not available outside Google Cloud; MaxText "
      "runs one process per host (docs/multihost.md)",
    ),
    "quant_cfg_path": Key(
      "quantization=intmp: a JSON from module-path regexes to {bits, scale, tile_size} (docs/low_precision.md).",
      acts_with=On("quantization", "intmp"),
    ),
    "checkpoint_is_quantized": Key(
      "decode.py: load_parameters_path holds int8 kernels with their scales (save_quantized_params_path wrote it)."
    ),
    "save_quantized_params_path": Key("decode.py with quantization=int8: write the params as int8 kernels and scales here."),
    "quantization_local_shard_count": Key(
      "quantization=int8: wgrad's batch in this many parts with own scales; 0: wgrad unquantized; -1: num_slices.",
      range=Range(0, also=(-1,), says="-1 (num_slices), 0 (wgrad in high precision) or a positive number of parts"),
      acts_with=On("quantization", "int8"),
    ),
    "enable_single_replica_ckpt_restoring": Key(
      "Restore a checkpoint with one data-parallel replica reading it and broadcasting to the others."
    ),
    "enable_emergency_checkpoint": Key(
      "Also save every local_checkpoint_period steps to each host's local_checkpoint_directory (a local tier)."
    ),
    "local_checkpoint_directory": Key(
      "A directory on each host's own disk (RAM disk or local SSD) for the local tier.",
      acts_with=_EMERGENCY,
    ),
    "local_checkpoint_period": Key("Steps between saves to the local tier.", range=NON_NEGATIVE, acts_with=_EMERGENCY),
    "enable_checkpoint_cloud_logger": Key(
      "Send Orbax's checkpoint events to Google Cloud Logging (where credentials exist)."
    ),
    "enable_checkpoint_standard_logger": Key(
      "Log Orbax's checkpoint events (saves, restores, durations) with Python logging."
    ),
    "expansion_factor_real_data": Key(
      "Upstream: hosts that load data for others; here every process loads its own rows.",
      refused="every process loads its own rows of the global batch here (docs/data.md); no process loads for others",
    ),
    "max_corpus_chars": Key(
      "Upstream's train_tokenizer limit; here train_tokenizer.py takes --max_corpus_chars.",
      refused="train.py trains no tokenizer: pass --max_corpus_chars to MaxText/train_tokenizer.py",
    ),
    "load_from_prefill_dir": Key("Upstream's JetStream prefill cache.", refused=f"load_from_prefill_dir {_JETSTREAM}"),
    "prefill_cache_dir": Key("Upstream's JetStream prefill cache.", refused=f"prefill_cache_dir {_JETSTREAM}"),
    "inference_microbenchmark_prefill_lengths": Key("inference_microbenchmark.py: the prompt lengths to time prefill at."),
    "inference_microbenchmark_stages": Key("inference_microbenchmark.py: prefill and/or generate, comma-separated."),
    "inference_microbenchmark_loop_iters": Key("inference_microbenchmark.py: timed runs of each stage.", range=POSITIVE),
    "inference_microbenchmark_log_file_path": Key("inference_microbenchmark.py: write the results' JSON here."),
    "inference_metadata_file": Key("Upstream's JetStream metadata.", refused=f"inference_metadata_file {_JETSTREAM}"),
    "enable_model_warmup": Key("Upstream's JetStream warm-up.", refused=f"enable_model_warmup {_JETSTREAM}"),
    "prometheus_port": Key("Upstream's JetStream metrics port.", refused=f"prometheus_port {_JETSTREAM}"),
    "enable_jax_profiler": Key("A profiler server for the run, to capture traces from on demand (jax.collect_profile)."),
    "jax_profiler_port": Key(
      "The profiler server's port.", range=Range(1, 65535), acts_with=On("enable_jax_profiler", True)
    ),
    "gcs_metrics": Key(
      "Write the steps' metrics as JSON lines to <run_dir>/metrics/metrics_step_<a>_to_step_<b>.txt, every log_period."
    ),
    "save_config_to_gcs": Key("Upstream: write the config to <run_dir>/config.yml; here it is always written."),
    "max_checkify": Key(
      "Checkify the train step: an out-of-bounds index or a NaN stops the run, naming the op and the step (slower)."
    ),
    "enable_goodput_recording": Key(
      "Record the run's events to <run_dir>/goodput/events.jsonl; MaxText/runtime/goodput.py RUN_DIR reports goodput."
    ),
    "monitor_goodput": Key("Log the goodput so far every goodput_upload_interval_seconds.", acts_with=_GOODPUT),
    "goodput_upload_interval_seconds": Key(
      "monitor_goodput: seconds between two goodput lines.", range=POSITIVE, acts_with=_GOODPUT
    ),
    "hf_access_token": Key(
      "A Hugging Face token for gated hub datasets (dataset_type=hf); empty: none, or the HF_TOKEN environment.",
    ),
  },
}
