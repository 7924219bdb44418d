"""Converts a generated Llama checkpoint of a few GB to MaxText and back, and reports wall time and peak RSS.

    python3 benchmarks/convert_checkpoint_benchmark.py [--work_dir /tmp/convert_bench] [--layers 4]

The checkpoint (float32, wide layers, sharded safetensors of at most 1 GiB) is written tensor by tensor, so
generating it needs little memory too. Each conversion runs as its own process (the real command line); its
peak RSS is read from getrusage(RUSAGE_CHILDREN) and must stay below half the checkpoint size (exit 1 if not).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from MaxText.hf_conversion import hf_io  # pylint: disable=wrong-import-position

# Wide layers, so that the checkpoint is large with few layers; no tensor is larger than 128 MiB.
DIMS = {
  "hidden_size": 4096,
  "intermediate_size": 8192,
  "num_attention_heads": 32,
  "num_key_value_heads": 8,
  "vocab_size": 8192,
}


def llama_tensors(layers: int) -> list[tuple[str, tuple, np.dtype]]:
  emb, mlp, vocab = DIMS["hidden_size"], DIMS["intermediate_size"], DIMS["vocab_size"]
  kv = emb // DIMS["num_attention_heads"] * DIMS["num_key_value_heads"]
  tensors = [("model.embed_tokens.weight", (vocab, emb))]
  for i in range(layers):
    prefix = f"model.layers.{i}."
    tensors += [
      (prefix + "input_layernorm.weight", (emb,)),
      (prefix + "self_attn.q_proj.weight", (emb, emb)),
      (prefix + "self_attn.k_proj.weight", (kv, emb)),
      (prefix + "self_attn.v_proj.weight", (kv, emb)),
      (prefix + "self_attn.o_proj.weight", (emb, emb)),
      (prefix + "post_attention_layernorm.weight", (emb,)),
      (prefix + "mlp.gate_proj.weight", (mlp, emb)),
      (prefix + "mlp.up_proj.weight", (mlp, emb)),
      (prefix + "mlp.down_proj.weight", (emb, mlp)),
    ]
  tensors += [("model.norm.weight", (emb,)), ("lm_head.weight", (vocab, emb))]
  return [(name, shape, np.dtype(np.float32)) for name, shape in tensors]


def write_checkpoint(directory: str, layers: int) -> int:
  """A random Llama checkpoint in sharded safetensors; returns its size in bytes."""
  os.makedirs(directory)
  tensors = llama_tensors(layers)
  shards = hf_io.plan_shards(tensors, max_bytes=2**30)
  files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  rng = np.random.default_rng(0)
  for shard, file in zip(shards, files):
    writer = hf_io.SafetensorsWriter(os.path.join(directory, file), shard)
    for name, shape, _ in shard:
      writer.write(name, rng.standard_normal(shape, dtype=np.float32) * 0.02)
    writer.close()
  hf_io.write_index(directory, shards, files)
  config = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": layers,
    "head_dim": DIMS["hidden_size"] // DIMS["num_attention_heads"],
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    **DIMS,
  }
  with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2)
  return sum(int(np.prod(shape)) * 4 for _, shape, _ in tensors)


def run_measured(args: list[str]) -> tuple[float, int]:
  """(wall seconds, peak RSS bytes) of `python3 MaxText/convert_checkpoint.py args` as a child process."""
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  start = time.time()
  command = [sys.executable, os.path.join(repo, "MaxText", "convert_checkpoint.py"), *args]
  pid = subprocess.Popen(command, cwd=repo, env=dict(os.environ, JAX_PLATFORMS="cpu")).pid  # pylint: disable=consider-using-with
  _, status, usage = os.wait4(pid, 0)
  if os.waitstatus_to_exitcode(status) != 0:
    raise SystemExit(f"{' '.join(command)} failed")
  return time.time() - start, usage.ru_maxrss * 1024  # Linux reports KiB


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--work_dir", default="/tmp/convert_checkpoint_benchmark")
  parser.add_argument("--layers", type=int, default=4)
  args = parser.parse_args()
  shutil.rmtree(args.work_dir, ignore_errors=True)
  hf_dir, maxtext_dir, hf_out = (os.path.join(args.work_dir, d) for d in ("hf", "maxtext", "hf_out"))
  size = write_checkpoint(hf_dir, args.layers)
  print(f"checkpoint: llama, {args.layers} layers, float32, {size / 2**30:.2f} GiB in {hf_dir}", flush=True)
  failed = False
  for what, command in (
    ("to_maxtext", ["to_maxtext", "--hf_path", hf_dir, "--output_dir", maxtext_dir]),
    ("to_hf", ["to_hf", "--maxtext_dir", maxtext_dir, "--output_dir", hf_out]),
  ):
    seconds, peak = run_measured(command)
    verdict = "OK" if peak < size / 2 else "FAIL (not below half the checkpoint)"
    failed |= peak >= size / 2
    print(
      f"{what}: wall {seconds:.1f} s, {size / 2**20 / seconds:.0f} MiB/s, peak RSS {peak / 2**30:.2f} GiB "
      f"= {peak / size:.0%} of the checkpoint: {verdict}",
      flush=True,
    )
  shutil.rmtree(args.work_dir, ignore_errors=True)
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
