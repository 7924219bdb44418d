"""Keys of base.yml's sections for the other entry points: decode.py and train_compile.py."""

from MaxText.configuration.common_types import COMPILE_SEARCHES, DECODE_SAMPLING_STRATEGIES
from MaxText.configuration.config_keys import POSITIVE, Key, Range

SECTIONS = {
  "Decoding (decode.py)": {
    "prompt": Key("The text to continue: prefilled into the KV cache (BOS if add_bos, no EOS)."),
    "max_prefill_predict_length": Key(
      "The longest prompt in tokens (BOS included); max_target_length minus it are generated.", range=POSITIVE
    ),
    "autoregressive_decode_assert": Key("If set, the first row's completion must equal it (a smoke test)."),
    "decode_sampling_strategy": Key(
      "greedy (the most likely token) | weighted | nucleus | topk.", choices=DECODE_SAMPLING_STRATEGIES
    ),
    "decode_sampling_temperature": Key(
      "Divides the logits before weighted, nucleus or topk sampling.", range=Range(0, low_open=True)
    ),
    "decode_sampling_nucleus_p": Key(
      "nucleus: sample among the most likely tokens holding this probability, in [0, 1] (0: the top token only)."
    ),
    "decode_sampling_top_k": Key("topk: sample among the k most likely tokens, 1 <= k <= vocab_size."),
    "decode_sampling_seed": Key("PRNG seed of the sampling."),
  },
  "Ahead-of-time compilation": {
    "compile_topology": Key("train_compile.py's target: v4-8 .. v4-4096, v5e-1 .., v5p-8 .., v6e-1 .., a3, cpu-N."),
    "compile_topology_num_slices": Key(
      "Slices of compile_topology (a3: hosts); -1 means 1.",
      range=Range(1, also=(-1,), says="a positive number of slices (-1 means 1)"),
    ),
    "compiled_trainstep_file": Key(
      "train_compile.py saves the compiled step here; train.py loads it instead of compiling (same shapes and topology)."
    ),
    "compile_search": Key(
      "train_compile.py: the largest per_device_batch_size that fits (value per_device_batch_size[,remat_policy]).",
      choices=COMPILE_SEARCHES,
    ),
  },
}
