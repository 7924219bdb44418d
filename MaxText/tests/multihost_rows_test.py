"""Each process loads exactly the batch rows its devices hold, on the meshes of real multi-host TPU slices.

The devices come from libtpu's topology descriptions (installed from PyPI on any CPU machine; each device
carries the index of the host process that owns it), so the layouts are the ones a v4-16, v5e-16 or
v5p-16 really has: hosts interleaved along fsdp, a wrapped ring, and rows held by several hosts when
tensor parallelism spans them. Every process's pipeline is built for that process, and the global batch
assembled from them is compared with the batch one process holding every device would load.
"""

import functools
import importlib.util
import math
import time

import numpy as np
import pytest

from MaxText.input_pipeline import sample_datasets
from MaxText.input_pipeline.batching import merge_process_states
from MaxText.input_pipeline.input_pipeline_interface import local_batcher
from MaxText.input_pipeline.multihost_dataloading import device_shard, process_rows
from MaxText.runtime import mesh as mesh_lib
from MaxText.runtime import sharding
from MaxText.tests.helpers import tiny_config

# libtpu's topology descriptions of 2- and 4-host slices (4 chips per host).
TOPOLOGIES = {
  "v4-16": dict(topology_name="v4:2x2x2", chip_config_name="megacore", chips_per_host_bounds=(2, 2, 1), wrap=(False,) * 3),
  "v5e-16": dict(
    topology_name="v5e:4x4", chip_config_name="default", chips_per_host_bounds=(2, 2, 1), wrap=(True, True, False)
  ),
  "v5p-16": dict(topology_name="v5p:2x2x2", chip_config_name="megacore", chips_per_host_bounds=(2, 2, 1), wrap=(False,) * 3),
}
# The default mesh (fsdp over every device), and tensor parallelism across hosts (a tensor axis that a
# host's 4 chips cannot hold alone, so several hosts hold the same rows).
MESHES = {
  "v4-16": ["ici_tensor_parallelism=8"],
  "v5e-16": ["ici_tensor_parallelism=4"],
  "v5p-16": ["ici_tensor_parallelism=8"],
}
CASES = [(name, []) for name in TOPOLOGIES] + [(name, flags) for name, flags in MESHES.items()]


@functools.cache
def topology_devices(name: str):
  if importlib.util.find_spec("libtpu") is None:
    pytest.fail("libtpu is not installed; the test requirements have it: pip install -r requirements-test.txt")
  from jax.experimental.topologies import get_topology_desc  # pylint: disable=import-outside-toplevel

  return get_topology_desc(platform="tpu", num_slices=1, **TOPOLOGIES[name]).devices


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
  """train.py flags of a random-access source (Grain ArrayRecord) and a streamed one (Parquet through hf)."""
  root = tmp_path_factory.mktemp("rows_data")
  texts = sample_datasets.split_texts("train", 400)
  sample_datasets.write_array_records(str(root / "train"), texts, num_shards=2)
  parquet = sample_datasets.write_parquet(str(root / "train.parquet"), texts)
  return {
    "grain": ["dataset_type=grain", f"grain_train_files={root}/train.array_record-*"],
    # Unshuffled: a shuffled hf stream that reaches the end of its file sleeps 5 s (datasets' Arrow shutdown
    # workaround), and this small file fits in the shuffle buffer. The grain case covers shuffling.
    "hf": ["dataset_type=hf", "hf_path=parquet", f"hf_train_files={parquet}", "enable_data_shuffling=false"],
  }


def _setup(name, flags, extra=()):
  devices = topology_devices(name)
  config = tiny_config("attention=dot_product", *flags, *extra, devices=devices)
  mesh = mesh_lib.create_device_mesh(config, devices=devices)
  return config, mesh, 1 + max(d.process_index for d in devices)


def _expected_rows(config, mesh, process: int) -> list[int]:
  """Independently of the sharding's index maps: a device's block of rows is the row-major index of its
  mesh coordinates along the data_sharding axes."""
  axes = config.data_sharding[0]
  sizes = [mesh.shape[a] for a in axes]
  rows_per_block = config.global_batch_size_to_load // math.prod(sizes)
  rows = set()
  for coords, device in np.ndenumerate(mesh.devices):
    if device.process_index == process:
      block = np.ravel_multi_index([coords[mesh.axis_names.index(a)] for a in axes], sizes) if sizes else 0
      rows.update(range(block * rows_per_block, (block + 1) * rows_per_block))
  return sorted(rows)


@pytest.mark.parametrize("name,flags", CASES)
def test_each_process_loads_the_rows_its_devices_hold(name, flags):
  config, mesh, num_processes = _setup(name, flags)
  num_rows = config.global_batch_size_to_load
  data_sharding = sharding.data_sharding(config, mesh)
  loaded = [process_rows(data_sharding, (num_rows, config.max_target_length), p) for p in range(num_processes)]
  assert loaded == [_expected_rows(config, mesh, p) for p in range(num_processes)]
  assert set().union(*loaded) == set(range(num_rows))
  if not flags and name != "v5e-16":  # the default mesh interleaves the two hosts along fsdp, 2 rows per device
    assert loaded[0] == [0, 1, 4, 5, 8, 9, 12, 13]
  if flags:  # tensor parallelism across hosts: several hosts hold the same rows
    assert len({tuple(r) for r in loaded}) < num_processes


@pytest.mark.parametrize("source", ["grain", "hf"])
@pytest.mark.parametrize("name,flags", CASES)
def test_global_batch_from_every_process_equals_the_one_process_batch(name, flags, source, sources):
  config, mesh, num_processes = _setup(name, flags, sources[source])
  num_rows, length = config.global_batch_size_to_load, config.max_target_length
  one, all_rows = local_batcher(config, mesh, True, num_rows, processes=range(num_processes))
  assert all_rows == list(range(num_rows))
  per_process = [local_batcher(config, mesh, True, num_rows, processes=[p]) for p in range(num_processes)]
  indices = sharding.data_sharding(config, mesh).devices_indices_map((num_rows, length))
  for _ in range(2):
    reference = next(one)
    assert reference["targets_segmentation"].all()  # real tokens everywhere: the comparison means something
    local = [next(iterator) for iterator, _ in per_process]
    for key, expected in reference.items():
      assembled = np.full((num_rows, length), -1, np.int32)
      for device, index in indices.items():
        p = device.process_index
        shard = device_shard(local[p][key], per_process[p][1], index, num_rows)
        np.testing.assert_array_equal(shard, expected[index], err_msg=f"{key} on {device}")
        assembled[index] = shard
      np.testing.assert_array_equal(assembled, expected)

  # The checkpointed positions of all processes, unioned, continue the one-process pipeline exactly.
  states = [iterator.get_state() for iterator, _ in per_process]
  resumed, _ = local_batcher(config, mesh, True, num_rows, processes=range(num_processes))
  resumed.set_state(merge_process_states(states[0], states))
  np.testing.assert_array_equal(next(resumed)["inputs"], next(one)["inputs"])


def test_the_data_is_said_used_up_when_the_consumer_reaches_its_end_not_the_read_ahead(capsys):
  """The prefetch thread reads ahead: an eval of eval_steps=1 over 3 batches must not say they were all used."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel

  from MaxText.input_pipeline.multihost_dataloading import GlobalBatchIterator  # pylint: disable=import-outside-toplevel
  from MaxText.input_pipeline.packing import BATCH_KEYS  # pylint: disable=import-outside-toplevel

  class ThreeBatches:
    def __init__(self):
      self.read = 0

    def __iter__(self):
      for self.read in range(1, 4):
        yield {k: np.ones((2, 4), np.int32) for k in BATCH_KEYS}

    def get_state(self):
      return {"read": self.read}

  sharding_ = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)), PartitionSpec("data"))
  batches = GlobalBatchIterator(ThreeBatches(), sharding_, (2, 4), [0, 1], "eval", prefetch=4)
  next(batches)
  deadline = time.monotonic() + 60
  while batches._padding is None and time.monotonic() < deadline:  # pylint: disable=protected-access
    time.sleep(0.01)  # until the read-ahead has reached the end of the data
  assert batches._padding is not None and "used up" not in capsys.readouterr().out  # pylint: disable=protected-access
  for _ in range(4):
    next(batches)
  batches.close()
  assert capsys.readouterr().out.count("Process 0: the eval data is used up after 3 batches") == 1
