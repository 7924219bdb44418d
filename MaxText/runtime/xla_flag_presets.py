"""Named sets of XLA flags (config key `xla_flags_preset`), added to XLA_FLAGS before JAX's backend starts.

XLA reads XLA_FLAGS once per process, when the first backend starts, so pyconfig.initialize applies the preset
before it looks up the devices. The user's own XLA_FLAGS are kept, and a flag the user set wins over the preset's.
"""

from MaxText import max_logging
from MaxText.errors import ConfigError

# The XLA flags of the "Maxtext on Vertex A3 Mega" guide (shared/reference/seed-docs/vertex-a3-mega.md, "XLA Flags"),
# tuned for a3-megagpu-8g nodes (8x H100, GPUDirect-TCPXO). Two of its flags no longer exist in the XLA of the jax
# release that requirements.txt pins, and an unknown flag aborts every process at backend start (CPU ones too):
#   --xla_gpu_graph_level=0 is written as its replacement --xla_gpu_enable_command_buffer= (an empty list: no CUDA
#     graphs; XLA's own shim for graph_level 0 cleared that list);
#   --xla_gpu_enable_triton_softmax_fusion=false is left out (XLA removed the flag and that fusion).
# --xla_dump_hlo_pass_re=.* writes nothing unless --xla_dump_to is set too (a debugging aid of the guide, kept).
A3MEGA = (
  "--xla_dump_hlo_pass_re=.*",
  "--xla_gpu_enable_latency_hiding_scheduler=true",
  "--xla_gpu_enable_triton_gemm=false",
  "--xla_gpu_enable_command_buffer=",
  "--xla_gpu_enable_highest_priority_async_stream=true",
  "--xla_gpu_all_reduce_combine_threshold_bytes=536870912",
  "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
  "--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864",
  "--xla_gpu_enable_pipelined_all_gather=true",
  "--xla_gpu_enable_pipelined_reduce_scatter=true",
  "--xla_gpu_enable_pipelined_all_reduce=true",
  "--xla_gpu_enable_while_loop_double_buffering=true",
  "--xla_gpu_enable_all_gather_combine_by_dim=false",
  "--xla_gpu_enable_reduce_scatter_combine_by_dim=false",
  "--xla_disable_hlo_passes=rematerialization",
)

PRESETS = {"a3mega": A3MEGA}


def flag_name(flag: str) -> str:
  """`--xla_gpu_graph_level=0` -> `xla_gpu_graph_level`."""
  return flag.lstrip("-").split("=", 1)[0]


def merged_flags(user_flags: str, preset_flags) -> tuple[str, list[str]]:
  """XLA_FLAGS with the preset's flags appended, except those the user already set.

  Args:
    user_flags: the current XLA_FLAGS value ("" if unset).
    preset_flags: the preset's flags, each `--name=value`.
  Returns:
    (the new XLA_FLAGS value, the preset flags that were appended).
  """
  user_names = {flag_name(token) for token in user_flags.split() if token.startswith("-")}
  added = [flag for flag in preset_flags if flag_name(flag) not in user_names]
  return " ".join([user_flags.strip(), *added]).strip(), added


# Flags of upstream's and the guides' XLA_FLAGS that the XLA of jax 0.10/0.11 no longer knows: XLA aborts every
# process on an unknown flag (a C++ fatal error, not a Python one), so they are named before the backend starts.
RETIRED = {
  "xla_gpu_graph_level": "XLA replaced it with --xla_gpu_enable_command_buffer (empty, as in "
  "--xla_gpu_enable_command_buffer=, for no CUDA graphs, which --xla_gpu_graph_level=0 meant)",
  "xla_gpu_enable_triton_softmax_fusion": "XLA removed it with that fusion: leave it out",
}


def check_user_flags(environ) -> None:
  """A ConfigError naming the first XLA_FLAGS entry that would abort XLA at backend start: a flag XLA retired, or a
  TPU compiler flag, which belongs in LIBTPU_INIT_ARGS (libtpu reads them; XLA_FLAGS does not know them)."""
  for token in environ.get("XLA_FLAGS", "").split():
    name = flag_name(token)
    if name in RETIRED:
      raise ConfigError(f"XLA_FLAGS has {token}: {RETIRED[name]}; XLA would abort on it")
    if name.startswith("xla_tpu_") or name == "xla_enable_async_all_gather":
      raise ConfigError(f"XLA_FLAGS has {token}, a TPU compiler flag: put it in LIBTPU_INIT_ARGS, which libtpu reads")


def apply(preset: str, environ) -> None:
  """Adds the preset's flags to environ["XLA_FLAGS"] (no-op for preset "") and logs which were added.

  Args:
    preset: a name in PRESETS, or "" for none (config_validation has already checked it).
    environ: the process environment (os.environ) that XLA will read.
  """
  if not preset:
    return
  new_value, added = merged_flags(environ.get("XLA_FLAGS", ""), PRESETS[preset])
  if not added:  # all set already (by the user, or by an earlier initialize in this process)
    return
  environ["XLA_FLAGS"] = new_value
  kept = len(PRESETS[preset]) - len(added)
  max_logging.log(
    f"xla_flags_preset={preset}: added to XLA_FLAGS: {' '.join(added)}"
    + (f" ({kept} of its flags left out: XLA_FLAGS already sets them)" if kept else "")
  )
  from MaxText.runtime import jax_runtime  # pylint: disable=import-outside-toplevel

  if jax_runtime.backends_started():
    max_logging.warn(
      f"xla_flags_preset={preset}: JAX's backend had already started in this process and XLA read XLA_FLAGS then, "
      "so these flags take effect only in a new process"
    )
