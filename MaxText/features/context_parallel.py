"""Context parallelism's load balancing as a feature: each batch's tokens reordered so that every context shard holds
an equal share of the causal work (layers/context_parallel.py), before the model sees them."""

from MaxText import feature_protocol
from MaxText.layers import context_parallel


class ContextLayout(feature_protocol.Feature):
  name = "context_layout"

  def __init__(self, config):
    self.layout = context_parallel.from_config(config)

  def prepare_batch(self, batch: dict) -> dict:
    return context_parallel.reorder(self.layout, batch)
