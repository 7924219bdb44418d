"""The device mesh: ICI (within a slice) x DCN (across slices) parallelism over the named mesh axes."""

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from MaxText import max_logging


def create_device_mesh(config, devices=None) -> Mesh:
  """A Mesh over config.mesh_axes with config.ici_parallelism x config.dcn_parallelism devices per axis.

  Args:
    config: the Config (its -1 parallelism values are already filled in).
    devices: the devices to lay out (default: all devices; an AOT target topology's devices otherwise).
  """
  devices = jax.devices() if devices is None else devices
  ici, dcn = list(config.ici_parallelism), list(config.dcn_parallelism)
  if config.num_slices > 1:
    grid = mesh_utils.create_hybrid_device_mesh(
      ici, dcn, devices, allow_split_physical_axes=config.allow_split_physical_axes
    )
  elif devices[0].platform in ("tpu", "gpu", "cuda", "rocm"):
    grid = mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=config.allow_split_physical_axes)
  else:  # CPU devices have no physical topology to respect.
    grid = np.array(devices).reshape(ici)
  mesh = Mesh(grid, config.mesh_axes)
  max_logging.log(f"Mesh: {len(devices)} devices, shape {dict(mesh.shape)}")
  return mesh
