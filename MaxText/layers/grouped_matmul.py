"""The routed experts' grouped matmuls: rows grouped by expert, each group times its expert's weights.

`GroupedMatmul` is the one function the MoE dispatches call, `(rows (m, k), weights (E, k, n), group_sizes (E,)) ->
(m, n)`; rows past sum(group_sizes) (padding, dropped choices) come out as 0 and get a zero gradient. Which kernel
multiplies (`from_config`, from `megablox` and the hardware the program compiles for):

- `megablox`: megablox's Pallas TPU kernels shipped with jax (`gmm` forward and input gradient, `tgmm` the grouped
  weight gradient), under a custom VJP here so that each pass takes its own tiling (upstream's wi_tile_* /
  wo_tile_* keys). Their FLOPs are those of the routed rows (XLA's TPU lowering of ragged_dot computes the weight
  gradient as a convolution dense over every group). On CPU devices it runs in the Pallas interpreter only inside
  `interpreted()` (tests); elsewhere on CPU, ragged_dot.
- `ragged_dot`: jax.lax.ragged_dot (megablox=false; CPU).
- `padded_tiles` (GPU): XLA's GPU lowering of ragged_dot expands it to a matmul dense over every group. Instead each
  group is padded to whole tiles of GPU_TILE_ROWS rows and a scan multiplies each used tile by its expert's weights:
  the routed rows plus at most a tile of padding per group, in plain JAX ops.
"""

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm, tgmm  # the kernels, without ops.gmm's custom VJP

from MaxText import max_logging

KERNELS = ("megablox", "ragged_dot", "padded_tiles")
PASSES = ("fwd", "dlhs", "drhs")
DIMS = ("batch_seq", "embed_dim", "mlp_dim")
# Tile caps where no key sets a tile: rows, then the embed and mlp dims (upstream's defaults).
DEFAULT_TILES = {"batch_seq": 512, "embed_dim": 1024, "mlp_dim": 1024}
GPU_TILE_ROWS = 128
_LANES = 128  # a TPU tile of a weight dim is a multiple of this, or the whole dim

_interpret_on_cpu = False


@contextlib.contextmanager
def interpreted():
  """Within it, megablox=true on CPU devices runs the Pallas kernels in the interpreter (tests) instead of ragged_dot.

  Read when a model is built (from_config), so the run's jitted step must be traced inside it.
  """
  global _interpret_on_cpu  # pylint: disable=global-statement
  previous, _interpret_on_cpu = _interpret_on_cpu, True
  try:
    yield
  finally:
    _interpret_on_cpu = previous


def _tile(key: int, size: int, cap: int, lanes: int) -> int:
  """The tile of a dim of `size`: the key's value (<= 0: from the shape), never above the dim."""
  if key > 0:
    return min(key, size)
  if size <= cap:
    return size
  fits = [t for t in range(lanes, cap + 1, lanes) if size % t == 0]
  return fits[-1] if fits else cap


@dataclasses.dataclass(frozen=True)
class GroupedMatmul:
  """How the experts multiply. Hashable (a Flax module field).

  Attributes:
    kernel: one of KERNELS.
    tiles: ((weight, pass, dim), tile) pairs: weight wi | wo, pass fwd | dlhs | drhs, dim as DIMS; <= 0 from the
      shapes.
    interpret: run the Pallas kernels in the interpreter (CPU devices, tests).
  """

  kernel: str = "ragged_dot"
  tiles: tuple = ()
  interpret: bool = False

  def __call__(self, lhs, rhs, group_sizes, weight: str = "wi"):
    """lhs (m, k) rows grouped by expert; rhs (E, k, n); group_sizes (E,) int32; weight: wi (k embed, n mlp) or wo.

    Returns (m, n) in lhs's dtype; rows past sum(group_sizes) are 0.
    """
    valid = (jnp.arange(lhs.shape[0]) < jnp.sum(group_sizes))[:, None]  # (m, 1)
    # Zeroed on the way in too: gmm's forward and input gradient leave NaN in those rows, and the input gradient
    # passes this select, which drops them.
    lhs = jnp.where(valid, lhs, jnp.zeros((), lhs.dtype))
    if self.kernel == "megablox":
      out = _megablox(lhs, rhs, group_sizes, self._tilings(weight, lhs.shape[0], *rhs.shape[1:]), self.interpret)
    elif self.kernel == "padded_tiles":
      out = padded_tiles(lhs, rhs, group_sizes, GPU_TILE_ROWS)
    else:
      out = jax.lax.ragged_dot(lhs, rhs, group_sizes)
    return jnp.where(valid, out, jnp.zeros((), out.dtype))

  def _tilings(self, weight: str, m: int, k: int, n: int):
    """(fwd, dlhs, drhs) tilings (rows, contracted, out) of gmm/tgmm for a (m, k) x (E, k, n) product of `weight`."""
    keys = dict(self.tiles)
    in_dim, out_dim = ("embed_dim", "mlp_dim") if weight == "wi" else ("mlp_dim", "embed_dim")
    size = {"batch_seq": m, in_dim: k, out_dim: n}

    def tile(p, dim):
      lanes = 8 if dim == "batch_seq" else _LANES
      return _tile(keys.get((weight, p, dim), -1), size[dim], DEFAULT_TILES[dim], lanes)

    fwd = (tile("fwd", "batch_seq"), tile("fwd", in_dim), tile("fwd", out_dim))
    dlhs = (tile("dlhs", "batch_seq"), tile("dlhs", out_dim), tile("dlhs", in_dim))  # contracts over n
    drhs = (tile("drhs", "batch_seq"), tile("drhs", in_dim), tile("drhs", out_dim))
    return fwd, dlhs, drhs


def _pad_rows(a, multiple: int):
  extra = -a.shape[0] % multiple
  return jnp.pad(a, ((0, extra), (0, 0))) if extra else a


def _row_tile(tilings) -> int:
  return math.lcm(*(t[0] for t in tilings))  # every pass's row tiles divide the padded rows


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _megablox(lhs, rhs, group_sizes, tilings, interpret):
  return _megablox_fwd(lhs, rhs, group_sizes, tilings, interpret)[0]


def _megablox_fwd(lhs, rhs, group_sizes, tilings, interpret):
  m = lhs.shape[0]
  padded = _pad_rows(lhs, _row_tile(tilings))  # gmm takes whole row tiles; the extra rows are past every group
  out = gmm(padded, rhs, group_sizes, lhs.dtype, tilings[0], interpret=interpret)
  return out[:m], (padded, rhs, group_sizes)


def _megablox_bwd(tilings, interpret, residuals, grad):
  padded, rhs, group_sizes = residuals
  m = grad.shape[0]
  grad = _pad_rows(grad, _row_tile(tilings))
  dlhs = gmm(grad, rhs, group_sizes, padded.dtype, tilings[1], transpose_rhs=True, interpret=interpret)
  # tgmm: the grouped weight gradient, lhs^T (k, m) x grad (m, n) per group; an empty group's is 0.
  drhs = tgmm(
    padded.swapaxes(0, 1), grad, group_sizes, rhs.dtype, tilings[2], num_actual_groups=rhs.shape[0], interpret=interpret
  )
  return dlhs[:m], drhs, None


_megablox.defvjp(_megablox_fwd, _megablox_bwd)


def padded_tiles(lhs, rhs, group_sizes, tile_rows: int):
  """ragged_dot's product over groups padded to whole tiles: a scan of (tile_rows, k) x (k, n) matmuls.

  At most ceil(m / tile_rows) + E tiles are used; a tile past the used ones is skipped (lax.cond). Rows past
  sum(group_sizes) go nowhere and come back 0. The weight gradient is each tile's, added into its expert's.
  """
  m, k = lhs.shape
  num_experts, n = rhs.shape[0], rhs.shape[2]
  num_tiles = -(-m // tile_rows) + num_experts
  ends = jnp.cumsum(group_sizes)
  tiles_per_group = -(-group_sizes // tile_rows)
  tile_ends = jnp.cumsum(tiles_per_group)  # (E,) in tiles
  group = jnp.searchsorted(ends, jnp.arange(m), side="right")  # (m,), E past the last group
  start = jnp.take(ends - group_sizes, group, mode="clip")
  tile_start = jnp.take(tile_ends - tiles_per_group, group, mode="clip")
  dest = jnp.where(group < num_experts, tile_start * tile_rows + jnp.arange(m) - start, num_tiles * tile_rows)
  buffer = jnp.zeros((num_tiles * tile_rows, k), lhs.dtype).at[dest].set(lhs, mode="drop")
  tile_expert = jnp.minimum(jnp.searchsorted(tile_ends, jnp.arange(num_tiles), side="right"), num_experts - 1)
  used = jnp.arange(num_tiles) < tile_ends[-1]

  def one_tile(args):
    rows, expert, is_used = args  # (tile_rows, k), (), ()
    return jax.lax.cond(is_used, lambda: rows @ rhs[expert], lambda: jnp.zeros((tile_rows, n), jnp.result_type(lhs, rhs)))

  out = jax.lax.map(one_tile, (buffer.reshape(num_tiles, tile_rows, k), tile_expert, used))
  return jnp.take(out.reshape(-1, n), dest, axis=0, mode="fill", fill_value=0).astype(lhs.dtype)


def tile_keys(config) -> tuple:
  """GroupedMatmul.tiles from the config: wi_tile_<pass>_<dim>, else tile_<dim> (upstream's benchmark keys)."""
  fallback = {"batch_seq": config.tile_batch_seq, "embed_dim": config.tile_embed_dim, "mlp_dim": config.tile_mlp_dim}
  tiles = []
  for weight in ("wi", "wo"):
    for p in PASSES:
      for dim in DIMS:
        value = getattr(config, f"{weight}_tile_{p}_{dim}")
        tiles.append(((weight, p, dim), value if value > 0 else fallback[dim]))
  return tuple(tiles)


@functools.cache
def _say_once(line: str) -> None:
  max_logging.log(line)


def from_config(config) -> GroupedMatmul:
  """The grouped matmul for the run's hardware (config.hardware: the devices it compiles for, AOT targets included)."""
  if not config.megablox:
    return GroupedMatmul("ragged_dot")
  if config.max_checkify:  # the experts then run without shard_map (moe_experts.ExpertsConfig.whole_batch)
    _say_once(
      "max_checkify=true: the experts' grouped matmuls run ragged_dot over the whole batch (megablox needs shard_map)"
    )
    return GroupedMatmul("ragged_dot")
  if config.hardware == "tpu":
    return GroupedMatmul("megablox", tile_keys(config))
  if config.hardware.startswith("gpu"):
    return GroupedMatmul("padded_tiles")
  if _interpret_on_cpu:
    return GroupedMatmul("megablox", tile_keys(config), interpret=True)
  _say_once("megablox=true: the Pallas TPU kernels do not run on CPU devices; the experts' grouped matmuls run ragged_dot")
  return GroupedMatmul("ragged_dot")
