"""opt_type=muon: optax's Muon (optax.contrib.muon) on each layer's weight matrices, AdamW on the other params.

Muon orthogonalises the momentum of a matrix W (x W = y) by Newton-Schulz iterations, as a (fan_in, fan_out)
matrix. The model's kernels are not all 2-D: a DenseGeneral kernel holds its input dims, then its output dims (the
attention query (embed, heads, head_dim), its output (heads, head_dim, embed)), and a scanned stack adds its layers
axis (at param_scan_axis), MoE experts an expert axis. So each param's dimension numbers (optax's
MuonDimensionNumbers: which axes are fan_in, which fan_out; every other axis is a batch axis, orthogonalised one
slice at a time) come from its logical axis names (the model's `nn.with_logical_partitioning` annotations), the same
names that shard it, with no path of any family written here:

- batch axes: `layers` (a scanned stack: each layer its own matrix), `exp` (each expert its own), and an unnamed axis
  inside a kernel (fused_mlp's activations, the fused qkv's three projections: separate matrices stacked);
- AdamW (Muon's usual split): a param with `vocab` (the token embedding, the logits kernel), `norm` (norms' scales
  and biases) or fewer than two matrix axes (vectors), and every `bias` (it carries its kernel's output names);
- the matrix of the others: `embed` (the residual stream) first: it is fan_in, the rest fan_out; `embed` last, or
  an unnamed axis last (LoRA's A into its rank, the router into its experts): it is fan_out, the rest fan_in;
  otherwise the first axis is fan_in (a low-rank up-projection: LoRA's B from its rank, MLA's wq_b and wkv_b).

Muon is an optimizer choice, not a feature: optimizers.py builds it for opt_type=muon. It alone needs the params'
logical axes, which training_setup gives as a function (an abstract init of the model, nothing allocated) that only
this optimizer calls. With LoRA, whose wrapper hands the optimizer the adapters alone, the adapters get Muon and the
frozen base is in no optimizer. The keys are upstream MaxText's: muon_beta, muon_weight_decay, muon_consistent_rms,
and the adam_* keys for the AdamW part (optax's, with Nesterov momentum as upstream's; adam_eps is also Muon's eps,
as upstream passes it).
"""

from collections.abc import Callable

import jax
import optax
from flax.core import meta
from optax.contrib import MuonDimensionNumbers

BATCH_AXES = ("layers", "exp")  # a stack of separate matrices
EMBED_AXES = ("embed", "embed_no_exp")  # the residual stream
ADAMW_AXES = ("vocab", "norm")  # the embedding and the logits kernel; norms


def _keys(path) -> tuple[str, ...]:
  return tuple(str(getattr(p, "key", p)) for p in path)


def dimension_numbers(keys: tuple[str, ...], names: tuple) -> MuonDimensionNumbers | None:
  """The Muon dimension numbers of the param at `keys` with logical axis names `names`; None: it gets AdamW."""
  if keys[-1] == "bias" or any(n in ADAMW_AXES for n in names):
    return None
  last = len(names) - 1
  matrix = [i for i, n in enumerate(names) if n not in BATCH_AXES and (n is not None or i in (0, last))]
  if len(matrix) < 2:
    return None
  first, final = names[matrix[0]], names[matrix[-1]]
  if first not in EMBED_AXES and (final in EMBED_AXES or final is None):
    return MuonDimensionNumbers(reduction_axis=tuple(matrix[:-1]), output_axis=(matrix[-1],))
  return MuonDimensionNumbers(reduction_axis=(matrix[0],), output_axis=tuple(matrix[1:]))


def dimension_table(param_axes) -> dict:
  """{param path keys: MuonDimensionNumbers or None} from a tree of the params' logical axis names (PartitionSpecs,
  as nn.get_partition_spec gives them)."""
  flat = jax.tree_util.tree_flatten_with_path(param_axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]
  return {_keys(path): dimension_numbers(_keys(path), tuple(spec)) for path, spec in flat}


def _is_box(x) -> bool:
  """A flax box (nn.LogicallyPartitioned): the params reach the optimizer's init boxed, its update not."""
  return isinstance(x, meta.AxisMetadata)


def create(config, learning_rate_schedule: optax.Schedule, param_axes: Callable[[], object]):
  """optax's Muon on the matrices that `param_axes()` (the params' logical axis names) tells, AdamW on the rest.

  Args:
    param_axes: () -> a tree of the params' logical axis names (PartitionSpecs), of the model's nesting.
  """
  table = dimension_table(param_axes())

  def weight_dimension_numbers(params):  # of the full params, or of a part (LoRA's adapters), boxed or not
    return jax.tree_util.tree_map_with_path(lambda path, _: table[_keys(path)], params, is_leaf=_is_box)

  return optax.contrib.muon(
    learning_rate=learning_rate_schedule,
    beta=config.muon_beta,
    eps=config.adam_eps,
    weight_decay=config.muon_weight_decay,
    adam_b1=config.adam_b1,
    adam_b2=config.adam_b2,
    adam_eps_root=config.adam_eps_root,
    adam_weight_decay=config.adam_weight_decay,
    muon_weight_dimension_numbers=weight_dimension_numbers,
    consistent_rms=config.muon_consistent_rms,
  )
