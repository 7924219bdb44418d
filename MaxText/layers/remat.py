"""remat_policy=custom: each named activation (a checkpoint_name in the layers) is recomputed, kept on the device or
offloaded to host memory until the backward pass needs it, as upstream MaxText's per-name keys say.

The names are upstream's (common_types.REMAT_NAMES); a family produces some of them (`produced_names`), and a name
the model does not produce, set to anything but its default, is one ConfigError line listing the model's names.
"""

import jax
from jax import checkpoint_policies as _cp

from MaxText.configuration import common_types
from MaxText.errors import ConfigError


def placements(config) -> dict[str, str]:
  """{name: remat | device | offload} from the config's per-name keys."""
  return {name: getattr(config, name) for name in common_types.REMAT_NAMES}


def custom_policy(config):
  """The jax checkpoint policy of remat_policy=custom: `device` names saved, `offload` names to pinned host memory."""
  where = placements(config)
  return _cp.save_and_offload_only_these_names(
    names_which_can_be_saved=[n for n, w in where.items() if w == "device"],
    names_which_can_be_offloaded=[n for n, w in where.items() if w == "offload"],
    offload_src="device",
    offload_dst="pinned_host",
  )


def offloaded(config) -> list[str]:
  """The names remat_policy=custom sends to host memory ([] for another policy)."""
  return [n for n, w in placements(config).items() if w == "offload"] if config.remat_policy == "custom" else []


def _names(jaxpr, found: set) -> set:
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "name":
      found.add(eqn.params["name"])
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else (value,):
        inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's, or a Jaxpr
        if hasattr(inner, "eqns"):
          _names(inner, found)
  return found


def produced_names(forward, *args) -> set:
  """The checkpoint names that `forward(*args)` computes (traced, not run: args may be ShapeDtypeStructs)."""
  return _names(jax.make_jaxpr(forward)(*args).jaxpr, set())


def check_names(config, produced: set) -> None:
  """A name set away from its default that the model does not produce is one ConfigError line."""
  defaults = {name: common_types.REMAT_NAME_DEFAULTS.get(name, "remat") for name in common_types.REMAT_NAMES}
  unknown = [n for n, w in placements(config).items() if w != defaults[n] and n not in produced]
  if unknown:
    setting = ", ".join(f"{n}={getattr(config, n)}" for n in unknown)
    ours = ", ".join(n for n in common_types.REMAT_NAMES if n in produced)
    raise ConfigError(
      f"remat_policy=custom: {setting}: decoder_block={config.decoder_block} computes no such activation; "
      f"its names are {ours}"
    )
