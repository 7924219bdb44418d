"""The device mesh: ICI (within a slice) x DCN (across slices) parallelism over the named mesh axes."""

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from MaxText import max_logging
from MaxText.errors import UserError


def slice_attribute(devices) -> str | None:
  """The device attribute that tells slices apart, or None for devices that form one slice.

  TPU slices and GPU hosts set `slice_index` (a single TPU slice's topology devices have none). CPU devices
  are all in slice 0, so there each process of a multi-process job counts as one slice (which lets tests
  exercise dcn_* axes across processes).
  """
  if devices[0].platform == "cpu":
    return "process_index"
  return "slice_index" if hasattr(devices[0], "slice_index") else None


def count_slices(devices) -> int:
  attribute = slice_attribute(devices)
  return len({getattr(d, attribute) or 0 for d in devices}) if attribute else 1


def create_device_mesh(config, devices=None) -> Mesh:
  """A Mesh over config.mesh_axes with config.ici_parallelism x config.dcn_parallelism devices per axis.

  Args:
    config: the Config (its -1 parallelism values are already filled in).
    devices: the devices to lay out (default: the config's, the first config.num_devices of jax.devices(); an AOT
      target topology's devices otherwise).
  """
  devices = jax.devices()[: config.num_devices] if devices is None else devices
  ici, dcn = list(config.ici_parallelism), list(config.dcn_parallelism)
  on_cpu = devices[0].platform == "cpu"  # CPU devices have no physical topology to respect
  try:
    if config.num_slices > 1:
      grid = mesh_utils.create_hybrid_device_mesh(
        ici,
        dcn,
        devices,
        process_is_granule=slice_attribute(devices) == "process_index",
        allow_split_physical_axes=config.allow_split_physical_axes,
      )
    elif not on_cpu:
      grid = mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=config.allow_split_physical_axes)
    else:
      grid = np.array(devices).reshape(ici)
  except NotImplementedError as error:  # jax cannot lay the axes out on the physical torus
    shape = ", ".join(f"{axis}={n}" for axis, n in zip(config.mesh_axes, ici) if n > 1)
    raise UserError(
      f"the mesh ({shape}) does not fit the devices' physical axes: each mesh axis must be a product of whole "
      f"physical axes ({' '.join(str(error).split())[:200]}); set allow_split_physical_axes=true to let an axis span "
      "parts of several, or choose sizes that fit"
    ) from None
  mesh = Mesh(grid, config.mesh_axes)
  slices = f" in {config.num_slices} slices" if config.num_slices > 1 else ""
  max_logging.log(f"Mesh: {len(devices)} devices{slices}, shape {dict(mesh.shape)}")
  return mesh
