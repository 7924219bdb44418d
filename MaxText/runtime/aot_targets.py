"""AOT compile targets: a `compile_topology` name -> the devices of that hardware, and what one device offers.

    target = aot_targets.lookup("v5e-256")
    devices = aot_targets.devices(target, num_slices=2)   # 512 TPU devices described by libtpu, on any host

TPU names follow Cloud TPU's (v4-8 ... v4-4096, v5e-1 ... v5e-256, v5p-8 ... v5p-17920, v6e-1 ... v6e-256): the
number counts TensorCores for v4/v5p (two per chip, one megacore JAX device) and chips for v5e/v6e. libtpu
describes these topologies on a CPU-only host. `a3` is one host of 8 H100 GPUs (a "slice" is one host): it needs
a GPU host. `cpu-N` is N devices of the local CPU platform, so compile -> save -> load -> train runs anywhere.
"""

import dataclasses
import os

from MaxText.errors import UserError

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  """One JAX device of a target: its kind (flops.py has its peak FLOP/s), memory and memory bandwidth, and its links
  (interconnect.py costs the step's collectives on them)."""

  device_kind: str
  memory_bytes: int | None  # None: the local host decides (cpu-N)
  memory_bandwidth_gbps: float  # GB/s of HBM (of RAM for CPU: a rough figure, for estimates only)
  ici_link_gbps: float  # one ICI link's bandwidth each way, GB/s (NVLink through NVSwitch for GPUs)
  ici_links: int  # ICI links per chip
  dcn_gbps: float  # the chip's share of its host's network bandwidth between slices (hosts), GB/s each way
  clock_ghz: float = 0.0  # the clock that the TPU compiler's estimated_cycles count (hlo_ops); 0: none


# TPU memory is what the TPU compiler lets one program use (libtpu 0.0.42 says so in its out-of-memory errors),
# a little less than the HBM's size (32, 16, 95 and 32 GiB).
# Links: the Cloud TPU system architecture pages (docs.cloud.google.com/tpu/docs/<version>).
#   v4: "bisection bandwidth per Pod 24 TB/s": a 16x16x16 torus is cut by 2 x 16 x 16 = 512 links, 46.9 GB/s each
#       way; 6 links (3D). Cloud TPU gives no DCN figure for v4: assumed v5e's 25 Gbps per chip (4-chip hosts
#       with one 100 Gbps NIC).
#   v5e: "bidirectional ICI bandwidth per chip 400 GBps, 4 ICI ports" (50 GB/s each way per link); "data center
#       network bandwidth per Pod 6.4 Tbps" over 256 chips = 25 Gbps = 3.125 GB/s per chip.
#   v5p: "bidirectional ICI bandwidth per chip 1200 GBps" over 6 links (100 GB/s each way); "DCN bandwidth per chip
#       50 Gbps" = 6.25 GB/s.
#   v6e: "bidirectional ICI bandwidth per chip 800 GBps, 4 ICI ports" (100 GB/s each way); no DCN figure published
#       there: assumed v5e's 3.125 GB/s per chip.
#   h100 (a3): NVLink 4 gives 900 GB/s per GPU both ways together (NVIDIA H100 datasheet), 450 GB/s each way through
#       NVSwitch to any GPU of the host; A3 Mega hosts have 8 x 200 Gbps NICs, 25 GB/s per GPU.
#   cpu: no real links: rough figures, so that cpu-N estimates stay comparable.
# Clock: the bf16 peak over the MXUs' multiply-adds per cycle (2 FLOPs each), from the same pages' "TensorCores per
# chip" and "MXUs per TensorCore": v4 275 TFLOP/s / (2 TCs x 4 MXUs x 128 x 128 x 2) = 1.05 GHz (the clock of the
# TPU v4 paper, Jouppi et al., ISCA 2023); v5e 197 / (1 x 4 x 128^2 x 2) = 1.50 GHz; v5p 459 / (2 x 4 x 128^2 x 2)
# = 1.75 GHz. v6e: its page gives 2 MXUs of 256x256, which would need 3.5 GHz for 918 TFLOP/s, but the compiler's own
# cycle estimates for large matmuls reach 463k FLOPs per cycle (a 120 GFLOP fusion of a 1B model on v6e-4), more
# than 2 such MXUs do (262k): its cycles are of 918 / (4 x 256^2 x 2) = 1.75 GHz. Checked the same way on the others:
# no matmul fusion of the published 22B (v4) and 16B (v5e) steps exceeds the peak at these clocks (at most 89%, 95%).
CHIPS = {
  "v4": Chip("TPU v4", int(30.75 * GIB), 1228.0, 46.9, 6, 3.125, 1.05),
  "v5e": Chip("TPU v5 lite", int(15.75 * GIB), 819.0, 50.0, 4, 3.125, 1.5),
  "v5p": Chip("TPU v5", int(95.74 * GIB), 2765.0, 100.0, 6, 6.25, 1.75),
  "v6e": Chip("TPU v6 lite", int(31.25 * GIB), 1640.0, 100.0, 4, 3.125, 1.75),
  "h100": Chip("NVIDIA H100 80GB HBM3", 80 * 10**9, 3350.0, 450.0, 1, 25.0),
  "cpu": Chip("cpu", None, 20.0, 10.0, 1, 1.0),
}


@dataclasses.dataclass(frozen=True)
class Target:
  """A compile_topology: how to describe its devices, and how many devices one slice has."""

  name: str
  platform: str  # tpu | gpu | cpu
  chip: Chip
  devices_per_slice: int
  topology: str = ""  # libtpu's name, e.g. "v5e:16x16"
  chip_config: str = "default"  # "megacore": one JAX device per chip of two TensorCores (v4, v5p)
  chips_per_host_bounds: tuple[int, int, int] = (2, 2, 1)
  wrap: tuple[bool, bool, bool] = (False, False, False)


def _v5e_like(generation: str, libtpu_name: str) -> dict[str, Target]:
  """Single-host shapes (1, 4, 8 chips) and pods of 4-chip hosts up to 16x16; 128 and 256 wrap around."""
  shapes = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}
  targets = {}
  for chips, (x, y) in shapes.items():
    bounds = {1: (1, 1, 1), 8: (2, 4, 1)}.get(chips, (2, 2, 1))
    wrap = {128: (False, True, False), 256: (True, True, False)}.get(chips, (False, False, False))
    name = f"{generation}-{chips}"
    targets[name] = Target(name, "tpu", CHIPS[generation], chips, f"{libtpu_name}:{x}x{y}", "default", bounds, wrap)
  return targets


def _megacore(generation: str, libtpu_name: str, shapes: str, wrap_from_chips: int) -> dict[str, Target]:
  """v4/v5p: `shapes` lists "cores:XxYxZ"; one device per chip; slices of 64+ chips are tori."""
  targets = {}
  for item in shapes.split():
    cores, shape = item.split(":")
    chips = int(cores) // 2
    wrap = (True, True, True) if chips >= wrap_from_chips else (False, False, False)
    name = f"{generation}-{cores}"
    targets[name] = Target(name, "tpu", CHIPS[generation], chips, f"{libtpu_name}:{shape}", "megacore", (2, 2, 1), wrap)
  return targets


_V4_SHAPES = (
  "8:2x2x1 16:2x2x2 32:2x2x4 64:2x4x4 128:4x4x4 256:4x4x8 384:4x4x12 512:4x8x8 1024:8x8x8 1536:8x8x12 "
  "2048:8x8x16 4096:8x16x16"
)
# v5p slice shapes as Cloud TPU provisions them (cores:XxYxZ).
_V5P_SHAPES = (
  "8:2x2x1 16:2x2x2 32:2x2x4 64:2x4x4 128:4x4x4 256:4x4x8 384:4x4x12 512:4x8x8 640:4x4x20 768:4x8x12 896:4x4x28 "
  "1024:8x8x8 1152:4x12x12 1280:4x8x20 1408:4x4x44 1536:8x8x12 1664:4x4x52 1792:4x8x28 1920:4x12x20 2048:8x8x16 "
  "2176:4x4x68 2304:8x12x12 2432:4x4x76 2560:8x8x20 2688:4x12x28 2816:4x8x44 2944:4x4x92 3072:8x12x16 3200:4x20x20 "
  "3328:4x8x52 3456:12x12x12 3584:8x8x28 3712:4x4x116 3840:8x12x20 3968:4x4x124 4096:8x16x16 4224:4x12x44 "
  "4352:4x8x68 4480:4x20x28 4608:12x12x16 4736:4x4x148 4864:4x8x76 4992:4x12x52 5120:8x16x20 5248:4x4x164 "
  "5376:8x12x28 5504:4x4x172 5632:8x8x44 5760:12x12x20 5888:4x8x92 6016:4x4x188 6144:12x16x16 6272:4x28x28 "
  "6400:8x20x20 6528:4x12x68 6656:8x8x52 6784:4x4x212 6912:12x12x24 7040:4x20x44 7168:8x16x28 7296:4x12x76 "
  "7424:4x8x116 7552:4x4x236 7680:12x16x20 7808:4x4x244 7936:4x8x124 8064:12x12x28 8192:16x16x16 8320:4x20x52 "
  "8448:8x12x44 8704:8x8x68 8832:4x12x92 8960:8x20x28 9216:12x16x24 9472:4x8x148 9600:12x20x20 9728:8x8x76 "
  "9856:4x28x44 9984:8x12x52 10240:16x16x20 10368:12x12x36 10496:4x8x164 10752:12x16x28 10880:4x20x68 "
  "11008:4x8x172 11136:4x12x116 11264:8x16x44 11520:12x20x24 11648:4x28x52 11776:8x8x92 11904:4x12x124 "
  "12032:4x8x188 12160:4x20x76 12288:16x16x24 13824:12x24x24 17920:16x20x28"
)

TPU_TARGETS = {
  **_megacore("v4", "v4", _V4_SHAPES, wrap_from_chips=64),
  **_v5e_like("v5e", "v5e"),
  **_megacore("v5p", "v5", _V5P_SHAPES, wrap_from_chips=64),
  **_v5e_like("v6e", "v6e"),
}
GPU_TARGETS = {"a3": Target("a3", "gpu", CHIPS["h100"], 8)}


def valid_names() -> str:
  """The accepted names, compactly: each TPU generation's range, a3 and cpu-N."""
  by_generation: dict[str, list[str]] = {}
  for name in TPU_TARGETS:
    by_generation.setdefault(name.split("-")[0], []).append(name)
  ranges = [f"{names[0]} ... {names[-1]}" for names in by_generation.values()]
  return ", ".join(ranges) + " (see MaxText/runtime/aot_targets.py for each size), a3 (8x H100 per host), cpu-N"


def lookup(name: str) -> Target:
  """The target of a compile_topology name; a UserError listing the valid names otherwise."""
  if name in TPU_TARGETS:
    return TPU_TARGETS[name]
  if name in GPU_TARGETS:
    return GPU_TARGETS[name]
  if name.startswith("cpu-") and name[4:].isdigit() and int(name[4:]) > 0:
    return Target(name, "cpu", CHIPS["cpu"], int(name[4:]))
  raise UserError(f"compile_topology={name} is not a known target; valid: {valid_names()}")


def devices(target: Target, num_slices: int) -> list:
  """The target's devices (num_slices slices of target.devices_per_slice), described without the hardware.

  Raises:
    UserError: libtpu is missing (TPU), this is not a GPU host (a3), or the process has too few CPU devices (cpu-N).
  """
  import jax  # pylint: disable=import-outside-toplevel

  from MaxText.runtime import jax_runtime  # pylint: disable=import-outside-toplevel

  if target.platform == "gpu":
    return _gpu_devices(target, num_slices)
  needed = target.devices_per_slice * num_slices
  if not jax_runtime.backends_started():
    # The local accelerator is not needed (and may be busy training): compile on the CPU backend, which
    # gets the cpu-N target's N devices unless XLA_FLAGS already asks for a count.
    if not jax.config.jax_platforms:
      jax.config.update("jax_platforms", "cpu")
    if target.platform == "cpu" and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
      jax.config.update("jax_num_cpu_devices", needed)
  if target.platform == "tpu":
    return _tpu_devices(target, num_slices)
  local = jax.devices("cpu")
  if len(local) < needed:
    raise UserError(
      f"compile_topology={target.name} with {num_slices} slice(s) needs {needed} CPU devices but this process has "
      f"{len(local)}: set XLA_FLAGS=--xla_force_host_platform_device_count={needed}"
    )
  if num_slices > 1:
    raise UserError(f"compile_topology={target.name} is one CPU host: use compile_topology_num_slices=1")
  return local[:needed]


def _tpu_devices(target: Target, num_slices: int) -> list:
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

  try:
    import libtpu  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    raise UserError(
      f"compile_topology={target.name} needs libtpu's topology description: install it with "
      "`bash setup.sh DEVICE=tpu` (works on a CPU-only host) or `pip install -r requirements-test.txt`"
    ) from None
  # Describing a topology needs no TPU: do not query a TPU VM's metadata server, and do not take the TPU lock
  # that a training job on this host may hold.
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-8")  # else libtpu logs errors about this host
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  description = topologies.get_topology_desc(
    platform="tpu",
    topology_name=target.topology,
    chip_config_name=target.chip_config,
    chips_per_host_bounds=target.chips_per_host_bounds,
    num_slices=num_slices,
    wrap=target.wrap,
  )
  return list(description.devices)


def _gpu_devices(target: Target, num_slices: int) -> list:
  """One real GPU host compiles for num_slices hosts: JAX mocks the other processes (as upstream MaxText does).

  Must run before JAX's backends start (train_compile.py looks the target up first).
  """
  import jax  # pylint: disable=import-outside-toplevel

  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_gpu_shard_autotuning" not in flags:  # autotuning would need the other hosts' GPUs
    os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_shard_autotuning=false".strip()
  jax.config.update("mock_num_gpu_processes", num_slices)
  found = jax.devices()
  if found[0].platform not in ("gpu", "cuda"):
    raise UserError(
      f"compile_topology={target.name} compiles for H100 hosts and must run on a GPU host (this one has "
      f"{found[0].platform} devices); TPU targets compile from any CPU"
    )
  return found
