"""The one place that chooses a run's features from its config, and their order.

The order matters where hooks chain: the optimizer wrappers nest in this order (LoRA's adapters-only optimizer wraps
the one that keeps the routing biases out); loss terms add in this order; on_start runs in this order and logical
in the reverse (the pipeline's memory order is the last change made to the state, and the first undone).
"""

from MaxText import feature_protocol
from MaxText.configuration import pipeline_schedule
from MaxText.features import (
  context_parallel,
  distillation,
  dpo,
  grpo,
  lora,
  losses,
  multimodal,
  numerics,
  pipeline_layout,
  quantization,
  routing_bias,
  z_loss,
)


def for_config(config) -> tuple[feature_protocol.Feature, ...]:
  """The features this config turns on."""
  chosen = []
  if context_parallel.ContextLayout(config).layout.load_balance:
    chosen.append(context_parallel.ContextLayout(config))
  if config.quantization:
    chosen.append(quantization.Quantization(config))
  if config.numerics_debug:
    chosen.append(numerics.NumericsStatistics(config))
  if routing_bias.present(config):
    chosen.append(routing_bias.RoutingBias(config))
  if config.use_multimodal:
    chosen.append(multimodal.Multimodal(config))
  if config.enable_lora:
    chosen.append(lora.Lora(config))
  if config.num_experts > 1:
    chosen.append(losses.MoeBalanceLoss(config))
  if config.mtp_num_layers > 0:
    chosen.append(losses.MtpLoss(config))
  if config.z_loss_multiplier > 0:
    chosen.append(z_loss.ZLoss(config))
  if config.use_distillation:
    chosen.append(distillation.Distillation(config))
  if config.use_dpo:
    chosen.append(dpo.Dpo(config, others=tuple(chosen)))
  if config.use_grpo:
    chosen.append(grpo.Grpo(config, others=tuple(chosen)))
  schedule = pipeline_schedule.resolve(config.get_keys())
  if schedule is not None and schedule.reorders_layers:
    chosen.append(pipeline_layout.PipelineLayout(config, others=tuple(chosen)))
  return tuple(chosen)
