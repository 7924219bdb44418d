"""The vocabulary of the conversion tables: which Hugging Face tensor feeds which MaxText param, and how.

A family module lists `Param`s; the conversion only permutes, reshapes, stacks and splits tensors (no
arithmetic on values), so a round trip HF -> MaxText -> HF gives back the same bytes.
"""

import dataclasses

import numpy as np

from MaxText.configuration import common_types

# How an HF tensor becomes a MaxText param (HF nn.Linear weights are (out, in); MaxText kernels are (in, out)).
#   identity   norms, embeddings                              (X,) -> (X,)
#   transpose  MLP and router kernels, logits                 (out, in) -> (in, out)
#   heads_in   query/key/value projections                    (N*D, E) -> (E, N, D)
#   heads_out  attention output projection                    (E, N*D) -> (N, D, E)
#   heads_bias query/key/value biases                         (N*D,) -> (N, D)
#   first_half, second_half   one of two params fused on the HF tensor's last axis (Llama 4's experts' gate_up_proj)
#   even, odd  one of two params interleaved on the HF tensor's last axis (GPT-OSS's gate_up_proj: gate, up, gate, ...)
#                                                             (..., 2M) -> (..., M); to_hf joins the two again
#   patches    a patch embedding's conv kernel                (out, C, p, p) -> (C, p, p, out)
OPS = ("identity", "transpose", "heads_in", "heads_out", "heads_bias", "first_half", "second_half", "even", "odd", "patches")
HALVES = ("first_half", "second_half")
INTERLEAVED = ("even", "odd")
PAIRED = HALVES + INTERLEAVED  # the ops of which two slices make one HF tensor (join_to_hf)


@dataclasses.dataclass(frozen=True)
class Param:
  """One MaxText param and where it lives in a Hugging Face checkpoint.

  Attributes:
    maxtext: the param's path, "/"-separated, below `params` (globals) or below one decoder layer (layer params).
    hf: the HF tensor name; "{i}" stands for the HF layer index and "{e}" for the expert index.
    op: one of OPS.
    experts: the MaxText param stacks the experts on its axis 0, one HF tensor per expert.
    untied_only: the param exists only without tied embeddings (logits_via_embedding=false).
    layer_offset: the HF layer of a block's param is block * Family.layers_per_block + layer_offset.
    optional: the model has the param in some configurations only (DeepSeek's query: low-rank or direct).
  """

  maxtext: str
  hf: str
  op: str = "identity"
  experts: bool = False
  untied_only: bool = False
  layer_offset: int = 0
  optional: bool = False

  def __post_init__(self):
    if self.op not in OPS:
      raise ValueError(f"op={self.op} is not one of {OPS}")


def to_maxtext(x: np.ndarray, op: str, shape: tuple) -> np.ndarray:
  """One HF tensor (one layer, one expert) in MaxText's layout, of the MaxText slice's `shape`."""
  if op == "identity":
    return x
  if op in HALVES:
    half = x.shape[-1] // 2
    return x[..., :half] if op == "first_half" else x[..., half:]
  if op == "transpose":
    return x.T
  if op == "patches":
    return x.transpose(1, 2, 3, 0)
  if op in INTERLEAVED:
    return x[..., INTERLEAVED.index(op) :: 2]
  if op == "heads_bias":
    return x.reshape(shape)
  return x.T.reshape(shape)  # heads_in (N*D, E) -> (E, N, D); heads_out (E, N*D) -> (N, D, E)


def join_to_hf(pieces: list[tuple[str, np.ndarray]]) -> np.ndarray:
  """One HF tensor from its (op, MaxText slice) pieces: one piece (to_hf), or two PAIRED ones joined (HALVES
  concatenated, INTERLEAVED alternating)."""
  if len(pieces) == 1:
    return to_hf(pieces[0][1], pieces[0][0])
  parts = dict(pieces)
  if sorted(parts) == sorted(HALVES) and len(pieces) == 2:
    return np.concatenate([parts["first_half"], parts["second_half"]], axis=-1)
  if sorted(parts) != sorted(INTERLEAVED) or len(pieces) != 2:
    raise ValueError(f"cannot make one tensor of slices with ops {[op for op, _ in pieces]}")
  even = parts["even"]
  out = np.empty((*even.shape[:-1], 2 * even.shape[-1]), even.dtype)
  out[..., 0::2], out[..., 1::2] = even, parts["odd"]
  return out


def to_hf(x: np.ndarray, op: str) -> np.ndarray:
  """The inverse of to_maxtext (of one piece; a PAIRED op's piece as it is: see join_to_hf)."""
  if op in ("identity", *PAIRED):
    return x
  if op == "heads_bias":
    return x.reshape(-1)
  if op == "transpose":
    return x.T
  if op == "patches":
    return x.transpose(3, 0, 1, 2)
  if op == "heads_in":
    return x.reshape(x.shape[0], -1).T  # (N*D, E)
  return x.reshape(-1, x.shape[-1]).T  # heads_out: (E, N*D)


def hf_shape(maxtext_shape: tuple, op: str) -> tuple:
  """The HF tensor shape that to_maxtext turns into `maxtext_shape` (one layer, one expert)."""
  if op == "identity":
    return tuple(maxtext_shape)
  if op in PAIRED:
    return (*maxtext_shape[:-1], 2 * maxtext_shape[-1])
  if op == "heads_bias":
    return (int(np.prod(maxtext_shape)),)
  if op == "transpose":
    return tuple(reversed(maxtext_shape))
  if op == "patches":
    return (maxtext_shape[-1], *maxtext_shape[:-1])
  if op == "heads_in":
    emb, heads, head_dim = maxtext_shape
    return (heads * head_dim, emb)
  heads, head_dim, emb = maxtext_shape
  return (emb, heads * head_dim)


@dataclasses.dataclass(frozen=True)
class Family:
  """A model family: its HF names, the MaxText decoder block, the param tables and the config mapping.

  Attributes:
    name: the family's name in messages and the README.
    model_types: HF config.json `model_type` values it reads.
    architecture: the HF class that to_hf names in config.json (`architectures`).
    decoder_block: the MaxText decoder_block it maps to.
    global_params: params outside the decoder layers.
    layer_params: params of one decoder layer.
    stack_params: for a family whose decoder has several stacks (common_types.SPLIT_STACKS), the params of one
      layer of each, by stack name in the order they run; None: layer_params is the one stack's (`layers`).
    mtp_params: the params of one multi-token prediction depth (decoder/mtp_<k>/...), HF layer num_hidden_layers +
      k - 1 (DeepSeek-V3's checkpoints append them as further layers); () where the conversion has none.
    checkpoint_keys: None, or (MaxText keys, the checkpoint's tensor names) -> the keys for what the checkpoint holds
      (transformers saves DeepSeek-V3 without the multi-token prediction layers its config.json counts).
    config_to_maxtext: HF config.json dict -> MaxText config keys (raises UserError on an unsupported variant).
    config_to_hf: MaxText config (attribute access) -> HF config.json keys.
    hf_tensor_name: None, or (config.json dict) -> a function from a checkpoint's tensor names to the names in
      layer_params and global_params (None hides a tensor): a checkpoint that holds the model under other names
      (Gemma 3's multimodal ones hold the text model under language_model).
    multimodal: the family of use_multimodal=true models (decoder_block names the text model's).
    own_numbering: stacks whose HF layers count from 0 (a vision encoder's), not on from the stacks before them.
  """

  name: str
  model_types: tuple
  architecture: str
  decoder_block: str
  global_params: tuple
  layer_params: tuple
  config_to_maxtext: object
  config_to_hf: object
  hf_tensor_name: object = None
  stack_params: dict | None = None
  mtp_params: tuple = ()
  checkpoint_keys: object = None
  multimodal: bool = False
  own_numbering: tuple = ()

  def layer_table(self, stack: str) -> tuple:
    """The params of one layer of the stack named `stack`."""
    return self.stack_params[stack] if self.stack_params else self.layer_params

  @property
  def stacks(self) -> tuple:
    return tuple(self.stack_params) if self.stack_params else ("layers",)

  @property
  def layers_per_block(self) -> int:
    """HF layers in one MaxText decoder block (Gemma 2 pairs a local and a global layer)."""
    return common_types.layers_per_block(self.decoder_block)
