"""YaRN RoPE scaling (transformers' rope_type "yarn"), shared by multi-head latent attention (DeepSeek-V3, which
truncates the ramp's ends to whole dimensions) and standard attention (GPT-OSS, which does not: truncate=false in its
rope_parameters)."""

import dataclasses
import math

import numpy as np


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (transformers' yarn_get_mscale); 1 for factor <= 1."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class YarnRopeScaling:
  """YaRN context extension (transformers' rope_type "yarn", as DeepSeek-V3's config sets it).

  Frequencies whose wavelength fits fewer than beta_slow times into original_max_position_embeddings are divided by
  `factor` (interpolated), those fitting more than beta_fast times are kept (extrapolated), with a linear ramp
  between. Attributes keep transformers' names; beta_fast and beta_slow of 0 mean its defaults 32 and 1.
  """

  factor: float
  original_max_position_embeddings: int
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 1.0
  mscale_all_dim: float = 0.0
  truncate: bool = True  # round the ramp's ends to whole dimensions (floor, ceil) as DeepSeek's; GPT-OSS: False

  def inverse_frequencies(self, pos_freqs, theta: float):
    """(D/2,) float32 theta**(2i/D) -> the YaRN angular frequencies (float32, as transformers computes them)."""
    f32 = np.float32
    dim = 2 * len(pos_freqs)

    def correction_dim(num_rotations):  # the dimension whose wavelength fits num_rotations times in the original
      return dim * math.log(self.original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(self.beta_fast or 32), correction_dim(self.beta_slow or 1)
    if self.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1).astype(f32)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: divide it by factor
    inv_extrapolated = f32(1) / pos_freqs
    inv_interpolated = f32(1) / (f32(self.factor) * pos_freqs)
    return (inv_interpolated * (1 - extrapolation) + inv_extrapolated * extrapolation).astype(f32)

  @property
  def attention_factor(self) -> float:
    """What transformers multiplies RoPE's cos and sin by (1 when mscale == mscale_all_dim, as in DeepSeek-V3)."""
    if self.mscale and self.mscale_all_dim:
      return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
    return _yarn_mscale(self.factor)

  @property
  def softmax_scale_multiplier(self) -> float:
    """DeepseekV3Attention's softmax scale is qk_head_dim**-0.5 times this: mscale(factor, mscale_all_dim)^2."""
    return _yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


def yarn_rope_scaling(
  factor: float | None,
  original_max_position_embeddings: int,
  beta_fast: float = 32.0,
  beta_slow: float = 1.0,
  mscale: float = 1.0,
  mscale_all_dim: float = 0.0,
  truncate: bool = True,
) -> YarnRopeScaling | None:
  """YarnRopeScaling from config values; None (plain RoPE) when factor is None or <= 0."""
  if factor is None or factor <= 0:
    return None
  return YarnRopeScaling(factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim, truncate)


def rope_frequencies(dim: int, theta: float, scaling: YarnRopeScaling | None):
  """(dim/2,) float32 angular frequencies 1 / theta^(2i/dim), YaRN-scaled when `scaling` is given."""
  pos_freqs = (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))).astype(np.float32)
  if scaling is None:
    return (np.float32(1) / pos_freqs).astype(np.float32)
  return scaling.inverse_frequencies(pos_freqs, theta)
