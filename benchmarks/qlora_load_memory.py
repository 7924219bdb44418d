"""Peak host memory of loading QLoRA's base from a float checkpoint: one kernel at a time vs the whole float base.

    python3 benchmarks/qlora_load_memory.py [key=value ...]   (model keys; default: 8 layers, emb 1024, mlp 4096)

Saves a float32 params checkpoint of the model, then loads it in a fresh process per way (on the CPU, the
devices' arrays are the process's memory, so the peak resident size is the load's peak):
  float:     enable_lora without lora_weight_qtype: the float base itself;
  whole:     the float base read whole, then quantized (how QLoRA loaded before qlora_loading.py);
  piecewise: starting_state.load_parameters with lora_weight_qtype: each float kernel read alone, then quantized.
Prints each way's peak resident memory above the process's before the load, in MiB.
"""

import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = [
  "base_num_decoder_layers=8",
  "base_emb_dim=1024",
  "base_mlp_dim=4096",
  "base_num_query_heads=8",
  "base_num_kv_heads=8",
  "head_dim=128",
  "vocab_size=4096",
  "weight_dtype=float32",
  "enable_lora=true",
  "lora_rank=16",
  "dataset_type=synthetic",
]


def _config(model_args, *args):
  from MaxText import pyconfig  # pylint: disable=import-outside-toplevel

  return pyconfig.initialize(["b", "MaxText/configs/base.yml", "run_name=b", *MODEL, *model_args, *args], environ={})


def _save(model_args, path: str) -> None:
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  from MaxText.features import lora
  from MaxText.runtime.mesh import create_device_mesh  # pylint: disable=import-outside-toplevel
  from MaxText.training import training_setup  # pylint: disable=import-outside-toplevel

  config = _config(model_args)
  mesh = create_device_mesh(config)
  setup = training_setup.build(config, mesh)
  state = setup.init_state(config, mesh)
  ocp.PyTreeCheckpointer().save(path, {"params": lora.split(state.params)[0]})


def _peak_kib() -> int:
  """This process's peak resident size (VmHWM: unlike ru_maxrss, not inherited from the parent across fork/exec)."""
  with open("/proc/self/status", encoding="utf-8") as f:
    return int(next(line.split()[1] for line in f if line.startswith("VmHWM:")))


def _measure(model_args, path: str, way: str) -> dict:
  import jax  # pylint: disable=import-outside-toplevel

  from MaxText.checkpoints import checkpointing  # pylint: disable=import-outside-toplevel
  from MaxText.features import lora, qlora_loading  # pylint: disable=import-outside-toplevel
  from MaxText.layers import qlora  # pylint: disable=import-outside-toplevel
  from MaxText.runtime.mesh import create_device_mesh  # pylint: disable=import-outside-toplevel
  from MaxText.training import starting_state, training_setup  # pylint: disable=import-outside-toplevel

  qtype = [] if way == "float" else ["lora_weight_qtype=int8"]
  config = _config(model_args, f"load_parameters_path={path}", *qtype)
  setup = training_setup.build(config, create_device_mesh(config))
  held = setup.abstract_state.params
  before = _peak_kib()
  if way == "whole":
    float_base = lora.split(qlora.float_layout(held, config.weight_dtype))[0]
    base = qlora_loading.quantize_all(checkpointing.load_params(path, float_base), held)
  else:
    base, _ = lora.split(starting_state.load_parameters(config, setup.features, held))
  jax.block_until_ready(base)
  peak = _peak_kib()
  held_bytes = sum(x.nbytes for x in jax.tree.leaves(base))
  return {"way": way, "peak_mib": (peak - before) / 1024, "held_mib": held_bytes / 2**20}


def main(argv) -> None:
  if len(argv) > 2 and argv[1] == "--measure":
    print(json.dumps(_measure(argv[4:], argv[3], argv[2])))
    return
  model_args = argv[1:]
  with tempfile.TemporaryDirectory() as out:
    path = os.path.join(out, "params")
    _save(model_args, path)
    results = []
    for way in ("float", "whole", "piecewise"):
      command = [sys.executable, __file__, "--measure", way, path, *model_args]
      result = subprocess.run(command, capture_output=True, text=True, check=True)
      results.append(json.loads(result.stdout.strip().splitlines()[-1]))
  for r in results:
    print(
      f"{r['way']:>9}: peak {r['peak_mib']:8.1f} MiB above the process before the load; params held {r['held_mib']:.1f} MiB"
    )


if __name__ == "__main__":
  main(sys.argv)
