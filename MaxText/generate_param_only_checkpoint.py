"""Turns a checkpoint into a params-only checkpoint for decoding or fine-tuning, in the layout you ask for.

    python3 MaxText/generate_param_only_checkpoint.py MaxText/configs/base.yml run_name=decode_ckpt \\
        load_full_state_path=<run>/checkpoints/<N>/items [force_unroll=true] [weight_dtype=bfloat16] <model keys...>

Reads the params of a training checkpoint (load_full_state_path) or of a params-only one
(load_parameters_path), and writes {"params": ...} to <base_output_directory>/<run_name>/checkpoints/0/items
in weight_dtype, with layers per-layer (layers_i) when force_unroll=true or scan_layers=false, else stacked
(scanned). Use the result as load_parameters_path.
"""

import os
import sys

if __package__ in (None, ""):  # Run as `python3 MaxText/generate_param_only_checkpoint.py`.
  sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from MaxText import pyconfig  # pylint: disable=wrong-import-position
from MaxText.errors import UserError  # pylint: disable=wrong-import-position
from MaxText.runtime.entry_point import run_and_exit_on_user_error  # pylint: disable=wrong-import-position


def _abstract_params(config, mesh, memory_limit_bytes):
  from MaxText.training import training_setup  # pylint: disable=import-outside-toplevel

  # Only the params are read (no optimizer state), so only they must fit a device.
  return training_setup.build(config, mesh, params_only=True, memory_limit_bytes=memory_limit_bytes).abstract_state.params


def _source_is_scanned(path: str) -> bool:
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  from MaxText.checkpoints import params_layout  # pylint: disable=import-outside-toplevel

  try:
    tree = ocp.PyTreeCheckpointer().metadata(path).item_metadata.tree
    return params_layout.is_scanned(tree["params"])
  except Exception as e:  # pylint: disable=broad-except
    raise UserError(f"{path} is not a MaxText checkpoint with params/decoder ({type(e).__name__}: {e})") from None


def generate(argv, memory_limit_bytes: int | None = None) -> str:
  """Writes the params-only checkpoint; returns its path.

  Args:
    argv: the command line (program name, config file, key=value ...).
    memory_limit_bytes: one device's memory, that the float32 params must fit; default: what a local device has.
  """
  config = pyconfig.initialize(argv, required_keys=("run_name",), reads_data=False)
  source = config.load_full_state_path or config.load_parameters_path
  if not source:
    raise UserError(
      "give the checkpoint to convert as load_full_state_path=<run>/checkpoints/<N>/items (or load_parameters_path)"
    )
  output = os.path.join(config.checkpoint_dir, "0", "items")
  # pylint: disable=import-outside-toplevel
  import jax
  import orbax.checkpoint as ocp
  from etils import epath

  from MaxText import max_logging
  from MaxText.checkpoints import checkpointing, layer_stacking
  from MaxText.layers import models
  from MaxText.runtime import mesh

  if epath.Path(output).exists():
    raise UserError(f"{output} already exists; choose another run_name (nothing is overwritten)")
  if not epath.Path(source).exists():
    raise UserError(f"{source} does not exist")
  scanned_in = _source_is_scanned(source)
  scanned_out = config.scan_layers and not config.force_unroll
  # Read with the source's layout, in float32 so that a cast happens once, at the end.
  read_config = pyconfig.initialize(
    argv,
    reads_data=False,
    scan_layers=scanned_in,
    weight_dtype="float32",
    load_parameters_path="",
    load_full_state_path="",
  )
  device_mesh = mesh.create_device_mesh(read_config)
  params = checkpointing.load_params(source, _abstract_params(read_config, device_mesh, memory_limit_bytes))
  decoder = params["decoder"]
  stacks = models.layer_stacks(config)  # scanned blocks per stack: Gemma 2 stacks (local, global) layer pairs
  if scanned_in and not scanned_out:
    decoder = layer_stacking.unstack_all(decoder, stacks, config.param_scan_axis)
  elif scanned_out and not scanned_in:
    decoder = layer_stacking.stack_all(decoder, stacks, config.param_scan_axis)
  params = dict(params, decoder=decoder)
  params = jax.tree.map(lambda x: x.astype(config.weight_dtype), params)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(output, {"params": params})
  checkpointer.wait_until_finished()
  layout = "scanned (layers)" if scanned_out else "per-layer (layers_i)"
  max_logging.log(f"Wrote {layout} {config.weight_dtype} params of {source} to {output}; use load_parameters_path={output}")
  return output


def main(argv) -> None:
  generate(argv)


if __name__ == "__main__":
  run_and_exit_on_user_error(main, sys.argv)
