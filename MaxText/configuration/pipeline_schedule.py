"""Pipeline parallelism's schedule: which layers each pipeline stage (mesh axis `stage`) holds, how each batch is cut
into microbatches, and the order the stages work through them. Pure Python: the config checks use it before JAX
starts; layers/pipeline.py runs it and pipeline_layout.py keeps the checkpoints free of it.

The schedule is the circular (interleaved) one. The first `pipeline_parallel_layers` layers are pipelined: they form
stages x repeats groups of `num_layers_per_pipeline_stage` consecutive layers, and group g = r x stages + s runs on
stage s in repeat r. So with repeats > 1 a stage holds several non-adjacent groups, and a microbatch goes round the
stages `repeats` times. Work item w (microbatch w % microbatches, repeat w // microbatches) enters stage 0 at
iteration w and reaches stage s at iteration w + delay x s; delay is 1, or 2 with
pipeline_delay_activation_forwarding (each transfer gets a whole iteration to overlap with compute). A microbatch's
next repeat starts on stage 0 only once its previous one has left the last stage, hence microbatches >= delay x
stages. The iterations where a stage has no work item are the bubble.

The layers after the pipelined ones run on every stage as a plain stack, with `stage` splitting the batch (data
parallelism).
"""

import dataclasses
import math

from MaxText.configuration import common_types
from MaxText.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The resolved pipeline of a run (stages > 1).

  Attributes:
    stages: the `stage` mesh axis (ici_pipeline_parallelism x dcn_pipeline_parallelism).
    microbatches: each (gradient-accumulation) microbatch's rows are cut into this many pipeline microbatches.
    repeats: times a microbatch goes round the stages.
    layers_per_stage: consecutive layers a stage runs per repeat.
    pipelined_layers: the stack's first layers, which go through the pipeline (stages x repeats x layers_per_stage).
    num_layers: the pipelined stack's layers (blocks).
    delay: iterations between one stage's output and the next stage's use of it (2 with
      pipeline_delay_activation_forwarding).
    stack: the stack of blocks that is pipelined, the model's last (decoder/<stack>): DeepSeek's moe_layers.
    first_block: the blocks of the stacks before it (DeepSeek's dense layers), which run before the pipeline with
      stage as data parallelism.
    block_layers: the model's layers in one block (2 where a block is a (local, global) pair): the pipeline keys
      count blocks.
  """

  stages: int
  microbatches: int
  repeats: int
  layers_per_stage: int
  pipelined_layers: int
  num_layers: int
  delay: int = 1
  stack: str = "layers"
  first_block: int = 0
  block_layers: int = 1

  @property
  def iterations(self) -> int:
    """Iterations of the pipeline loop: every work item, plus the fill and drain (the bubble)."""
    return self.microbatches * self.repeats + self.delay * (self.stages - 1)

  @property
  def bubble(self) -> float:
    """The share of the stages' iterations that do no work."""
    return self.delay * (self.stages - 1) / self.iterations

  def line(self) -> str:
    unit = "layers" if self.block_layers == 1 else f"blocks of {self.block_layers} layers"
    after = self.num_layers - self.pipelined_layers
    rest = f"; the last {after} layers run after it with stage as data parallelism" if after else ""
    if self.first_block:
      rest += f"; the first {self.first_block} layers run before it with stage as data parallelism"
    delayed = ", activations forwarded a step late" if self.delay > 1 else ""
    return (
      f"Pipeline: {self.stages} stages, {self.microbatches} microbatches, {self.repeats} repeats, "
      f"{self.layers_per_stage} {unit} per stage{delayed}; bubble {100 * self.bubble:.1f}% "
      f"({self.delay * (self.stages - 1)} of {self.iterations} iterations){rest}"
    )

  def memory_order(self) -> tuple[int, ...]:
    """The layer (in model order) at each position of the layer axis as the run holds it in memory.

    The stage axis splits the layer axis into `stages` contiguous chunks; chunk s holds stage s's pipelined groups
    (repeat-major), then its share of the layers after the pipeline. Identity for one repeat of all layers."""
    after = (self.num_layers - self.pipelined_layers) // self.stages
    order = []
    for s in range(self.stages):
      for r in range(self.repeats):
        start = (r * self.stages + s) * self.layers_per_stage
        order.extend(range(start, start + self.layers_per_stage))
      start = self.pipelined_layers + s * after
      order.extend(range(start, start + after))
    return tuple(order)

  @property
  def reorders_layers(self) -> bool:
    """Whether memory_order differs from the model's order (then checkpoints are saved in the model's order)."""
    return self.repeats > 1 or self.pipelined_layers < self.num_layers


def stages(values) -> int:
  """The `stage` mesh axis's size, from the resolved mesh (pyconfig's ici_parallelism/dcn_parallelism)."""
  if "stage" not in values["mesh_axes"] or "ici_parallelism" not in values:
    return 1
  axis = list(values["mesh_axes"]).index("stage")
  return values["ici_parallelism"][axis] * values["dcn_parallelism"][axis]


def resolve(values) -> "Schedule | None":
  """Checks the pipeline keys against the model and the batch (one ConfigError line each) and returns the schedule,
  or None without pipeline stages. `values` holds the resolved mesh (ici_parallelism, dcn_parallelism) and
  micro_batch_size_to_load."""
  n = stages(values)
  if n == 1:
    return None
  stacks = common_types.layer_stacks(values["decoder_block"], values["num_decoder_layers"], values["first_num_dense_layers"])
  stack, layers = list(stacks.items())[-1]  # the last stack is pipelined; those before it run before the pipeline
  block_layers = values["num_decoder_layers"] // sum(stacks.values())
  unit = "layers" if block_layers == 1 else f"blocks of {block_layers} layers"  # what the pipeline keys count
  pipelined = values["pipeline_parallel_layers"]
  if pipelined == -1:
    pipelined = layers
  if pipelined > layers:
    whose = (
      f"the model's {layers} {unit}" if len(stacks) == 1 else f"the {layers} {unit} of decoder/{stack}, the pipelined stack"
    )
    raise ConfigError(f"pipeline_parallel_layers={pipelined} is more than {whose}")
  per_stage = values["num_layers_per_pipeline_stage"]
  repeats = values["num_pipeline_repeats"]
  if repeats == -1:
    repeats = pipelined // (n * per_stage) if pipelined % (n * per_stage) == 0 else 0
  if repeats < 1 or n * per_stage * repeats != pipelined:
    raise ConfigError(
      f"{pipelined} pipelined {unit} do not split into {n} stages x num_layers_per_pipeline_stage={per_stage} x "
      f"num_pipeline_repeats={values['num_pipeline_repeats']}; make stages x layers per stage x repeats = "
      f"{pipelined} (pipeline_parallel_layers sets how many layers are pipelined)"
    )
  if (layers - pipelined) % n:
    raise ConfigError(
      f"the {layers - pipelined} {unit} after the pipeline (pipeline_parallel_layers={pipelined} of {layers}) must "
      f"divide over the {n} stages"
    )
  delay = 2 if values["pipeline_delay_activation_forwarding"] else 1
  micro = values["num_pipeline_microbatches"]
  if micro == -1:
    micro = delay * n
  if micro % n:
    raise ConfigError(f"num_pipeline_microbatches={micro} must be a multiple of the {n} pipeline stages")
  if micro < delay * n:
    raise ConfigError(
      f"num_pipeline_microbatches={micro}: pipeline_delay_activation_forwarding needs at least 2 x stages = "
      f"{delay * n} microbatches"
    )
  rows = values["micro_batch_size_to_load"]
  if rows % micro:
    accumulation = values["gradient_accumulation_steps"]
    per = f"the {rows} rows of each of the {accumulation} accumulation steps" if accumulation > 1 else f"the {rows} rows"
    raise ConfigError(
      f"num_pipeline_microbatches={micro} does not divide {per} (per_device_batch_size x devices); make the rows a "
      "multiple of the microbatches"
    )
  first = sum(stacks.values()) - layers
  return Schedule(n, micro, repeats, per_stage, pipelined, layers, delay, stack, first, block_layers)


def microbatch_shards(values, schedule: Schedule, mesh_shape: dict) -> None:
  """Each pipeline microbatch's rows, in training and in eval, must split over the batch's mesh axes other than
  stage."""
  shards = math.prod(mesh_shape[a] for a in values["data_sharding"][0] if a != "stage")
  micro = schedule.microbatches
  batches = [("", values["micro_batch_size_to_load"])]
  if values["eval_interval"] > 0:
    batches.append(("eval ", values["global_batch_size_to_load_eval"]))
  for what, rows in batches:
    if rows % micro or (rows // micro) % shards:
      raise ConfigError(
        f"the {rows} {what}rows do not split into num_pipeline_microbatches={micro} microbatches of a multiple of "
        f"the {shards} batch shards (data_sharding without stage); change the batch or the microbatches"
      )
