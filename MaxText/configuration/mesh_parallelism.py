"""The mesh's per-axis parallelism from the ici_*/dcn_*_parallelism keys: the -1 filled, the products checked
against the devices and slices (pyconfig derives the mesh shape with these)."""

import math

from MaxText.configuration import common_types
from MaxText.errors import ConfigError


def fill(values, prefix: str, total: int, what: str) -> list[int]:
  """The per-mesh-axis parallelism of one level (ici or dcn), with its -1 filled so the product is total."""
  keys = [f"{prefix}_{common_types.MESH_AXIS_KEY[axis]}_parallelism" for axis in values["mesh_axes"]]
  dims = [values[k] for k in keys]
  known = math.prod(d for d in dims if d != -1)
  if -1 in dims:
    if total % known:
      fixed = ", ".join(f"{k}={d}" for k, d in zip(keys, dims) if d not in (1, -1)) or "the others"
      raise ConfigError(
        f"{keys[dims.index(-1)]}=-1 cannot be filled: {what} {total} is not divisible by {fixed} (product {known})"
      )
    dims[dims.index(-1)] = total // known
  elif known != total:
    set_keys = ", ".join(f"{k}={d}" for k, d in zip(keys, dims) if d != 1) or f"all {prefix}_*_parallelism=1"
    raise ConfigError(
      f"{prefix}_*_parallelism multiply to {known} ({set_keys}) but there are {total} {what}; make the product {total}"
    )
  return dims


def check_no_dcn(values):
  """With one slice there is nothing to split across slices: a dcn_* value other than 1 (or the -1 fill) is a mistake."""
  for axis in values["mesh_axes"]:
    key = f"dcn_{common_types.MESH_AXIS_KEY[axis]}_parallelism"
    if values[key] not in (1, -1):
      ici_key = f"ici_{common_types.MESH_AXIS_KEY[axis]}_parallelism"
      raise ConfigError(
        f"{key}={values[key]} but there is one slice (dcn_* parallelism splits across slices); "
        f"use {ici_key} within a slice, or {key}=1"
      )
