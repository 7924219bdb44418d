"""Trains and decodes several mesh layouts in one process, and reports losses, tokens and shardings as JSON.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python3 -m MaxText.tests.sharded_runs RUNS.json REPORT.json

RUNS.json is a list of {"name", "devices", "args", "decode", "probes", "may_refuse"}: `devices` (1 or all) picks the
first devices of jax.devices() for pyconfig and the mesh, so a 1-device baseline and the 8-device layouts
share one JAX start-up and one compilation cache; `args` are base.yml overrides; `decode` runs decoding.generate
instead of train.train_loop; `probes` name the modules (paths such as decoder/layers/self_attention/query)
whose output sharding to report; `may_refuse` reports a run's UserError as {"refused": its line}. Decoded logits
go to REPORT.json.<name>.npy. Used by multi_device_test.py.
"""

import json
import math
import os
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from MaxText import pyconfig, train
from MaxText.diagnostics import numerics_log
from MaxText.errors import UserError
from MaxText.inference import decoding
from MaxText.runtime import jax_runtime, mesh, sharding
from MaxText.tests.helpers import BASE_YML, TEST_JAX_CACHE_DIR, read_metrics
from MaxText.training import training_setup

PROMPT = [1, 5, 9, 200, 7, 31]


def _shard(shape, named) -> list:
  """[per-device shard shape, partition spec] of an array of `shape` under a NamedSharding.

  Rounded up: a constraint may split a dimension unevenly (e.g. 4 heads 8 ways), which shard_shape refuses.
  """
  spec = tuple(named.spec) + (None,) * (len(shape) - len(named.spec))
  axes = [(a,) if isinstance(a, str) else tuple(a or ()) for a in spec]
  ways = [math.prod(named.mesh.shape[a] for a in dim_axes) for dim_axes in axes]
  return [[-(-n // w) for n, w in zip(shape, ways)], str(named.spec)]


def _shards(tree) -> dict:
  """{path: [shard shape, spec]} of every array (or ShapeDtypeStruct) in a tree."""
  return {jax.tree_util.keystr(p): _shard(x.shape, x.sharding) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def activation_shards(model, config, device_mesh, abstract_params, probes) -> dict:
  """{module path: [shard shape, spec]} of the outputs of the `probes` modules in the compiled forward pass
  (scanned layers' outputs stacked over the layers first).

  The forward pass returns those outputs (flax's capture_intermediates) with out_shardings left to the compiler,
  so each comes out as the SPMD partitioner sharded it inside the program: after propagation, not only what a
  constraint asked for, and with no change to model code. (jax.debug.inspect_array_sharding says the same, but a
  program with its host callback is never served from the compilation cache.) It is compiled, never run.
  """

  def forward(params, tokens, positions):
    _, variables = model.apply(
      {"params": params},
      tokens,
      positions,
      capture_intermediates=lambda module, method: method == "__call__" and "/".join(module.path) in probes,
      mutable=["intermediates"],
    )
    flat = traverse_util.flatten_dict(variables["intermediates"], sep="/")
    return {path.removesuffix("/__call__"): out[0] for path, out in flat.items() if path.endswith("/__call__")}

  batch = jax.ShapeDtypeStruct(
    (config.global_batch_size_to_load, config.max_target_length),
    jnp.int32,
    sharding=sharding.data_sharding(config, device_mesh),
  )
  with sharding.logical_context(device_mesh, config):
    lowered = jax.jit(forward).lower(abstract_params, batch, batch)
    shardings = lowered.compile().output_shardings
  return {path: _shard(lowered.out_info[path].shape, shardings[path]) for path in shardings}


def _adam_moments_sharded_as_params(state) -> bool:
  """Adam's mu and nu have the params' shardings (the optimizer state is sharded as the params)."""
  params = jax.tree.map(lambda x: x.sharding.spec, state.params)
  moments = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: hasattr(s, "mu")) if hasattr(s, "mu")]
  return bool(moments) and all(jax.tree.map(lambda x: x.sharding.spec, m) == params for s in moments for m in (s.mu, s.nu))


def train_run(config, probes) -> dict:
  state = train.train_loop(config)
  device_mesh = mesh.create_device_mesh(config)  # train_loop's: over the config's devices
  metrics = read_metrics(config.metrics_file)
  report = {
    "mesh": dict(device_mesh.shape),
    "metrics": {key: [m[key] for m in metrics] for key in metrics[0] if key.startswith("learning/")},
    "per_device_tokens": metrics[0]["perf/per_device_tokens"],
    "params": _shards(state.params),
    "opt_state_as_params": _adam_moments_sharded_as_params(state),
  }
  if "fp8_meta" in state.slots:  # each fp8 state's scale, and its amax history's oldest entry (step 0's amax)
    report["fp8_meta"] = {  # train_loop returns the state in the model's layer order
      jax.tree_util.keystr(p): np.asarray(x if x.ndim < 2 else x[..., -1]).tolist()
      for p, x in jax.tree_util.tree_leaves_with_path(state.slots["fp8_meta"])
    }
  stats = os.path.join(config.run_dir, numerics_log.STATS_DIR, numerics_log.STATS_FILE)
  if os.path.exists(stats):  # numerics_debug_config's statistics, as rows
    with open(stats, encoding="utf-8") as f:
      report["numerics"] = [json.loads(line) for line in f]
  if probes:
    abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state.params)
    report["activations"] = activation_shards(
      training_setup.create_model(config), config, device_mesh, abstract_params, probes
    )
  return report


def decode_run(config, logits_path) -> dict:
  """Greedy decoding of PROMPT with the KV cache; the cache's sharding comes from a compiled prefill."""
  device_mesh = mesh.create_device_mesh(config)
  model, abstract_params = decoding.build(config, device_mesh)
  params = decoding.load_params(config, model, abstract_params, device_mesh)
  result = decoding.generate(config, model, params, device_mesh, PROMPT, keep_logits=True)
  np.save(logits_path, result.logits)

  def prefill_cache(params, tokens, positions):
    _, variables = model.apply({"params": params}, tokens, positions, mutable=["cache"])
    return nn.unbox(variables["cache"])

  shape = (config.micro_batch_size_to_load, config.max_prefill_predict_length)
  tokens = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding.data_sharding(config, device_mesh))
  with sharding.logical_context(device_mesh, config):
    shapes = jax.eval_shape(prefill_cache, params, tokens, tokens)
    # Out shardings left to the compiler: what the cache's logical constraint makes of it.
    shardings = jax.jit(prefill_cache).lower(params, tokens, tokens).compile().output_shardings
  cache = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
  return {
    "mesh": dict(device_mesh.shape),
    "tokens": result.tokens.tolist(),
    "params": _shards(params),
    "cache": _shards(cache),
  }


def main(runs_path: str, report_path: str) -> None:
  with open(runs_path, encoding="utf-8") as f:
    runs = json.load(f)
  jax_runtime.enable_compilation_cache(TEST_JAX_CACHE_DIR)
  report = {"device_count": jax.device_count()}
  for run in runs:
    # A config made for the first devices: create_device_mesh lays its mesh over those.
    devices = jax.devices()[: run["devices"]]
    start = time.perf_counter()
    try:
      config = pyconfig.initialize(["sharded_runs", BASE_YML, *run["args"]], environ={}, devices=devices)
      if run.get("decode"):
        report[run["name"]] = decode_run(config, f"{report_path}.{run['name']}.npy")
      else:
        report[run["name"]] = train_run(config, run.get("probes", ()))
    except UserError as refusal:  # a run that may be refused reports its one line
      if not run.get("may_refuse"):
        raise
      report[run["name"]] = {"refused": str(refusal)}
    report[run["name"]]["seconds"] = time.perf_counter() - start
  with open(report_path, "w", encoding="utf-8") as f:
    json.dump(report, f)


if __name__ == "__main__":
  main(*sys.argv[1:])
