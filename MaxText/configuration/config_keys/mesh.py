"""Keys of base.yml's Mesh and parallelism section: the mesh axes, how many ways each splits, and the sharding rules."""

from MaxText.configuration.common_types import CONTEXT_PARALLEL_STRATEGIES, MESH_AXIS_KEY
from MaxText.configuration.config_keys import POSITIVE, Key, Range

# One -1 per level is filled so that the product is the devices per slice (ici) or the slices (dcn).
_DCN = Range(1, also=(-1,), says="a positive integer, or -1 to fill the remaining slices")
_ICI = Range(1, also=(-1,), says="a positive integer, or -1 to fill the remaining devices")
_PIPELINE = "Pipeline stages (mesh axis stage): the decoder's layers are split over them (docs/parallelism.md)."

SECTIONS = {
  "Mesh and parallelism": {
    "mesh_axes": Key("The mesh axes, in order; each set by its ici_/dcn_*_parallelism.", choices=tuple(MESH_AXIS_KEY)),
    "data_sharding": Key("The mesh axes that split the batch dimension of every input array: [[axis, ...]]."),
    # Across slices (data center network)
    "dcn_data_parallelism": Key("Ways the slices split over mesh axis data (replicas).", range=_DCN),
    "dcn_pipeline_parallelism": Key(_PIPELINE, range=_DCN),
    "dcn_fsdp_parallelism": Key(
      "Ways the slices split over mesh axis fsdp (sharded params and optimizer state).", range=_DCN
    ),
    "dcn_fsdp_transpose_parallelism": Key("Ways the slices split over mesh axis fsdp_transpose.", range=_DCN),
    "dcn_sequence_parallelism": Key("Ways the slices split over mesh axis sequence.", range=_DCN),
    "dcn_context_parallelism": Key(
      "Ways the slices split over mesh axis context (the sequence, attention included).", range=_DCN
    ),
    "dcn_tensor_parallelism": Key("Ways the slices split over mesh axis tensor.", range=_DCN),
    "dcn_expert_parallelism": Key("Ways the slices split over mesh axis expert.", range=_DCN),
    "dcn_autoregressive_parallelism": Key("Ways the slices split over mesh axis autoregressive.", range=_DCN),
    # Within a slice (inter-chip interconnect)
    "ici_data_parallelism": Key("Ways the devices of a slice split over mesh axis data (replicas).", range=_ICI),
    "ici_pipeline_parallelism": Key(_PIPELINE, range=_ICI),
    "ici_fsdp_parallelism": Key(
      "Ways the devices of a slice split over mesh axis fsdp (sharded params and optimizer state).", range=_ICI
    ),
    "ici_fsdp_transpose_parallelism": Key("Ways the devices of a slice split over mesh axis fsdp_transpose.", range=_ICI),
    "ici_sequence_parallelism": Key("Ways the devices of a slice split over mesh axis sequence.", range=_ICI),
    "ici_context_parallelism": Key(
      "Ways the devices of a slice split over mesh axis context (the sequence, attention included).", range=_ICI
    ),
    "ici_tensor_parallelism": Key("Ways the devices of a slice split over mesh axis tensor.", range=_ICI),
    "ici_expert_parallelism": Key("Ways the devices of a slice split over mesh axis expert.", range=_ICI),
    "ici_autoregressive_parallelism": Key("Ways the devices of a slice split over mesh axis autoregressive.", range=_ICI),
    "allow_split_physical_axes": Key("Let a mesh axis span parts of several physical device axes (jax mesh_utils)."),
    "num_layers_per_pipeline_stage": Key("Consecutive layers that a pipeline stage runs per repeat.", range=POSITIVE),
    "num_pipeline_repeats": Key(
      "Times each microbatch goes round the pipeline stages (the circular schedule); -1: derived.",
      range=Range(1, also=(-1,), says="a positive integer, or -1: pipelined layers / (stages x layers per stage)"),
    ),
    "num_pipeline_microbatches": Key(
      "Pipeline microbatches per (accumulation) microbatch; a multiple of the stages; -1: the stages.",
      range=Range(1, also=(-1,), says="a positive multiple of the stages, or -1: the stages"),
    ),
    "pipeline_parallel_layers": Key(
      "The first layers, pipelined; the others run after them with stage as data parallelism; -1: all.",
      range=Range(1, also=(-1,), says="a positive number of layers, or -1: all"),
    ),
    "scan_pipeline_iterations": Key("Scan the pipeline's iterations (false: unroll them, a longer compile)."),
    "pipeline_delay_activation_forwarding": Key(
      "Forward each stage's output an iteration late to overlap it: twice the bubble, >= 2 x stages microbatches."
    ),
    "pipeline_fsdp_ag_once": Key("All-gather the pipelined weights over fsdp once per step, not every iteration."),
    "context_parallel_strategy": Key(
      "How attention sees the keys of other context shards: all_gather (gather them) or ring (pass blocks around).",
      choices=CONTEXT_PARALLEL_STRATEGIES,
    ),
    "context_parallel_load_balance": Key(
      "Give each context shard the same causal work (chunks d, 2N-1-d of 2N); length divisible by 2 x shards."
    ),
    "logical_axis_rules": Key(
      "[logical axis, mesh axes] pairs; an array dim takes the first rule of its name whose axes it leaves unused."
    ),
  },
}
