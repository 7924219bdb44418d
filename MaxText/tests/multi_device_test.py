"""Every mesh axis on 8 forced CPU devices: the same losses (and decoded tokens and logits) as one device, with
the train state, the KV cache and an activation sharded as logical_axis_rules say.

One child process (sharded_runs.py) runs every layout: the device count is fixed at JAX start-up, and a config
made for the first device gives the 1-device baselines in the same process, so all share one start-up.
"""

import json

import numpy as np
import pytest

from MaxText.tests.helpers import run_python, tiny_args

# The tiny model: emb 32, 4 query and 2 kv heads of 8, mlp 64, 2 scanned layers (the param axis 1), vocab 4096;
# 8 rows of 32 tokens (8 per device on one device, 1 per device on 8).
QUERY = "['decoder']['layers']['self_attention']['query']['kernel']"
KEY = "['decoder']['layers']['self_attention']['key']['kernel']"
OUT = "['decoder']['layers']['self_attention']['out']['kernel']"
WI = "['decoder']['layers']['mlp']['wi_0']['kernel']"
WO = "['decoder']['layers']['mlp']['wo']['kernel']"
EMBEDDING = "['token_embedder']['embedding']"
LOGITS = "['decoder']['logits_dense']['kernel']"
# Activations, stacked over the 2 layers: the query projection (B, T, heads, head_dim), the MLP's first projection
# (B, T, mlp) and the MoE block's output (B, T, embed).
QUERY_OUT, MLP_OUT = "decoder/layers/self_attention/query", "decoder/layers/mlp/wi_0"
MOE_OUT = "decoder/layers/MoeBlock_0"

# name -> (parallelism, per-device shards of params, of activations). ici_fsdp_parallelism (-1) fills the rest.
DENSE = {
  # data: params whole on every device, rows split.
  "data": (["ici_data_parallelism=8"], {QUERY: [32, 2, 4, 8], WI: [32, 2, 64]}, {QUERY_OUT: [2, 1, 32, 4, 8]}),
  # fsdp: the embed dim of every weight split, rows split.
  "fsdp": (
    ["ici_fsdp_parallelism=8"],
    {QUERY: [4, 2, 4, 8], WI: [4, 2, 64], EMBEDDING: [4096, 4]},
    {QUERY_OUT: [2, 1, 32, 4, 8]},
  ),
  # fsdp_transpose: the mlp dim of the MLP weights split (the embed dim of the others), rows split.
  "fsdp_transpose": (
    ["ici_fsdp_transpose_parallelism=8"],
    {QUERY: [4, 2, 4, 8], WI: [32, 2, 8], WO: [8, 2, 32]},
    {QUERY_OUT: [2, 1, 32, 4, 8], MLP_OUT: [2, 1, 32, 64]},
  ),
  # sequence: activations split over the length (attention gathers the keys), weights' embed dim as fsdp.
  "sequence": (
    ["ici_sequence_parallelism=8", "attention=dot_product"],
    {QUERY: [4, 2, 4, 8], WI: [4, 2, 64]},
    {QUERY_OUT: [2, 8, 4, 4, 8], MLP_OUT: [2, 8, 4, 64]},
  ),
  # tensor: heads, mlp and vocab split (here with fsdp 4).
  "tensor": (
    ["ici_tensor_parallelism=2"],
    {
      EMBEDDING: [4096 // 2, 32 // 4],
      QUERY: [32 // 4, 2, 4 // 2, 8],
      KEY: [32 // 4, 2, 2 // 2, 8],
      OUT: [4 // 2, 2, 8, 32 // 4],
      WI: [32 // 4, 2, 64 // 2],
      WO: [64 // 2, 2, 32 // 4],
      LOGITS: [32 // 4, 4096 // 2],
    },
    {QUERY_OUT: [2, 2, 32, 2, 8], MLP_OUT: [2, 2, 32, 32]},
  ),
  # autoregressive (for decoding; trains too): heads, mlp and vocab weights split (here with fsdp 4).
  "autoregressive": (
    ["ici_autoregressive_parallelism=2"],
    {QUERY: [8, 2, 2, 8], WI: [8, 2, 32], EMBEDDING: [4096 // 2, 32 // 4]},
    {QUERY_OUT: [2, 2, 32, 2, 8]},
  ),
  # Three at once: rows over fsdp, the length over sequence, heads and mlp over tensor.
  "fsdp_sequence_tensor": (
    ["ici_fsdp_parallelism=2", "ici_sequence_parallelism=2", "ici_tensor_parallelism=2", "attention=dot_product"],
    {QUERY: [8, 2, 2, 8], WI: [8, 2, 32]},
    {QUERY_OUT: [2, 4, 16, 2, 8], MLP_OUT: [2, 4, 16, 32]},
  ),
}

E = 4  # experts
MIXTRAL = ["decoder_block=mixtral", f"num_experts={E}", "num_experts_per_tok=2"]
MOE_WI = "['decoder']['layers']['MoeBlock_0']['wi_0']"
MOE_WO = "['decoder']['layers']['MoeBlock_0']['wo']"
# name -> (parallelism, per-device shards of the experts' weights (E, layers, embed, mlp) and (E, layers, mlp, embed),
# of the MoE block's output (B, T, embed): its tokens stay split over the batch axes, `expert` included).
MOE = {
  # Experts over `expert` (4), the embed dim over fsdp (the remaining 2).
  "expert": (
    ["ici_expert_parallelism=4"],
    {MOE_WI: [E // 4, 2, 32 // 2, 64], MOE_WO: [E // 4, 2, 64, 32 // 2]},
    {MOE_OUT: [2, 1, 32, 32]},
  ),
  # Dropless with the mlp dim over `tensor` (partial outputs summed).
  "expert_tensor": (
    ["ici_expert_parallelism=4", "ici_tensor_parallelism=2"],
    {MOE_WI: [E // 4, 2, 32, 64 // 2], MOE_WO: [E // 4, 2, 64 // 2, 32]},
    {MOE_OUT: [2, 2, 32, 32]},
  ),
}
CAPACITY = ["capacity_factor=1.0"]  # drops tokens (the losses differ from dropless)

DECODE = ["max_target_length=24", "max_prefill_predict_length=8", "remat_policy=none", "dataset_type=synthetic"]
DECODE_AUTOREGRESSIVE = ["ici_fsdp_parallelism=4", "ici_autoregressive_parallelism=2"]


def _runs(tmp_path) -> list[dict]:
  def run(name, devices, *args, decode=False, probes=()):
    per_device = "per_device_batch_size=8" if devices == 1 else "per_device_batch_size=1"
    common = [f"base_output_directory={tmp_path}", f"run_name={name}", per_device]
    if not decode:
      common += ["steps=5", "learning_rate=1e-2", "enable_checkpointing=false", f"metrics_file={tmp_path / name}.jsonl"]
    return {"name": name, "devices": devices, "args": tiny_args(*common, *args), "decode": decode, "probes": probes}

  dense_probes, moe_probes = (QUERY_OUT, MLP_OUT), (MOE_OUT,)
  return [
    run("dense_one", 1),
    *(run(name, 8, *args, probes=dense_probes) for name, (args, _, _) in DENSE.items()),
    run("fractional", 8, "ici_tensor_parallelism=2", "per_device_batch_size=0.25"),
    run("moe_one", 1, *MIXTRAL),
    *(run(name, 8, *MIXTRAL, *args, probes=moe_probes) for name, (args, _, _) in MOE.items()),
    run("capacity_one", 1, *MIXTRAL, *CAPACITY),
    run("capacity_expert_tensor", 8, *MIXTRAL, *CAPACITY, *MOE["expert_tensor"][0]),
    run("decode_one", 1, *DECODE, decode=True),
    run("decode_autoregressive", 8, *DECODE, *DECODE_AUTOREGRESSIVE, decode=True),
  ]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  tmp_path = tmp_path_factory.mktemp("axes")
  runs_path, report_path = tmp_path / "runs.json", tmp_path / "report.json"
  runs_path.write_text(json.dumps(_runs(tmp_path)))
  # LLVM optimisation level 0 halves the compile time of a cold cache; the SPMD partitioning under test is the same.
  xla_flags = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
  env = {"XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu"}
  result = run_python(["-m", "MaxText.tests.sharded_runs", str(runs_path), str(report_path)], env_extra=env)
  assert result.returncode == 0, result.stderr[-5000:]
  out = json.loads(report_path.read_text())
  assert out["device_count"] == 8
  print({name: round(run["seconds"], 1) for name, run in out.items() if isinstance(run, dict)})
  out["logits"] = {name: np.load(f"{report_path}.{name}.npy") for name in ("decode_one", "decode_autoregressive")}
  return out


def _assert_mesh(run, args):
  """The run's mesh has the ici_<axis>_parallelism of its args (and 8 devices in all)."""
  for arg in args:
    if arg.startswith("ici_"):
      key, value = arg.split("=")
      assert run["mesh"][key.removeprefix("ici_").removesuffix("_parallelism")] == int(value), (arg, run["mesh"])
  assert np.prod(list(run["mesh"].values())) == 8


def _assert_same_losses(run, baseline, keys=("learning/loss",)):
  for key in keys:
    np.testing.assert_allclose(run["metrics"][key], baseline["metrics"][key], rtol=1e-5, err_msg=key)


def _assert_shards(found, expected, what):
  assert {k: found[k][0] for k in expected} == expected, (what, {k: found[k] for k in expected})


@pytest.mark.parametrize("name", DENSE)
def test_each_axis_trains_as_one_device_with_its_shardings(report, name):
  args, params, activations = DENSE[name]
  run, one = report[name], report["dense_one"]
  _assert_mesh(run, args)
  assert one["mesh"] == dict.fromkeys(one["mesh"], 1)
  assert run["metrics"]["learning/total_weights"] == [8 * 32] * 5
  _assert_same_losses(run, one)
  assert one["metrics"]["learning/loss"][-1] < one["metrics"]["learning/loss"][0]
  _assert_shards(run["params"], params, "params")
  _assert_shards(run["activations"], activations, "activations")
  assert run["opt_state_as_params"]
  assert one["params"][EMBEDDING][0] == [4096, 32]


def test_fractional_per_device_batch_trains_on_fewer_rows(report):
  run = report["fractional"]
  # 0.25 x 8 devices = 2 rows of 32 tokens per step.
  assert run["metrics"]["learning/total_weights"] == [2 * 32] * 5
  assert run["per_device_tokens"] == 0.25 * 32


@pytest.mark.parametrize("name", MOE)
def test_expert_parallel_dropless_trains_as_one_device(report, name):
  args, params, activations = MOE[name]
  run, one = report[name], report["moe_one"]
  _assert_mesh(run, args)
  _assert_same_losses(run, one, keys=("learning/loss", "learning/moe_lb_loss"))
  _assert_shards(run["params"], params, "expert weights")
  assert all("expert" in run["params"][k][1] for k in params)
  _assert_shards(run["activations"], activations, "activations")
  assert run["opt_state_as_params"]


def test_expert_parallel_capacity_dispatch_trains_as_one_device(report):
  run, one = report["capacity_expert_tensor"], report["capacity_one"]
  _assert_mesh(run, MOE["expert_tensor"][0])
  _assert_same_losses(run, one, keys=("learning/loss", "learning/moe_lb_loss"))
  _assert_shards(run["params"], MOE["expert_tensor"][1], "expert weights")
  dropless = report["moe_one"]["metrics"]["learning/loss"]
  assert not np.allclose(one["metrics"]["learning/loss"], dropless, rtol=1e-5)  # tokens were dropped


def test_autoregressive_decoding_gives_the_one_device_tokens_and_logits(report):
  run, one = report["decode_autoregressive"], report["decode_one"]
  _assert_mesh(run, DECODE_AUTOREGRESSIVE)
  assert np.array(run["tokens"]).shape == (8, 16) and run["tokens"] == one["tokens"]
  # rtol 1e-5 of the logits' scale: float32 sums in another order differ by ~1e-6 at every logit, also near 0.
  logits, one_logits = report["logits"]["decode_autoregressive"], report["logits"]["decode_one"]
  np.testing.assert_allclose(logits, one_logits, rtol=1e-5, atol=1e-5 * np.abs(one_logits).max())
  # The KV cache (layers, rows, slots, kv heads, head_dim): rows over fsdp, kv heads over autoregressive.
  for name in ("cached_key", "cached_value"):
    assert run["cache"][f"['decoder']['layers']['self_attention']['{name}']"][0] == [2, 8 // 4, 24, 2 // 2, 8]
  assert run["params"][QUERY][0] == [32 // 4, 2, 4 // 2, 8] and run["params"][WI][0] == [32 // 4, 2, 64 // 2]
