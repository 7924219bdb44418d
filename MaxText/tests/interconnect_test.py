"""The communication part of train_compile.py's estimate: collectives read from HLO text, their loops' trip counts,
and their ring costs on a target's links, against closed forms computed by hand."""

import pytest

from MaxText.aot import hlo_collectives, interconnect, roofline
from MaxText.aot.interconnect import Device
from MaxText.runtime import aot_targets

GB = 1e9


def _ring(n: int, slice_=0) -> list[Device]:
  return [Device(slice_, (i, 0, 0)) for i in range(n)]


def _hlo(body: str, loop: str = "", trip: str = "") -> str:
  """A minimal compiled-program text: an entry that runs `body`'s computation in a while loop (or directly)."""
  condition = (
    "%cond (p: (s32[])) -> pred[] {\n"
    "  %p = (s32[]) parameter(0)\n"
    "  %i = s32[] get-tuple-element(%p), index=0\n"
    f"  %n = s32[]{{:T(128)}} constant({loop or 1})\n"
    "  ROOT %lt = pred[] compare(%i, %n), direction=LT\n"
    "}\n"
  )
  return (
    "HloModule m\n\n"
    f"%body (p: (s32[])) -> (s32[]) {{\n{body}\n  ROOT %t = (s32[]) tuple(%x)\n}}\n\n"
    f"{condition}\n"
    "ENTRY %main (a: f32[8]) -> (s32[]) {\n"
    "  %a = f32[8] parameter(0)\n"
    "  %init = (s32[]) tuple(%a)\n"
    f"  ROOT %w = (s32[]) while(%init), condition=%cond, body=%body{trip}\n"
    "}\n"
  )


ALL_GATHER = "  %x = bf16[8,1024,1024]{2,1,0} all-gather(%y), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}"


def test_an_all_gather_over_an_8_chip_ring_takes_the_closed_form_time():
  found = hlo_collectives.collectives(_hlo(ALL_GATHER))
  assert len(found) == 1 and found[0].kind == "all-gather" and found[0].group_size == 8
  size = 8 * 1024 * 1024 * 2  # the gathered bf16 result
  assert found[0].bytes == size
  ring = interconnect.Fabric(link_gbps=50.0, dims=(8, 1, 1), wrap=(True, False, False), dcn_gbps=3.125)
  line = interconnect.Fabric(link_gbps=50.0, dims=(8, 1, 1), wrap=(False, False, False), dcn_gbps=3.125)
  # (n - 1) / n of the result arrives over 2 links (both ways round the torus), or 1 along a line.
  assert interconnect.step_seconds(found, _ring(8), ring, 1)["ici_loop"] == pytest.approx(7 / 8 * size / (2 * 50 * GB))
  assert interconnect.step_seconds(found, _ring(8), line, 1)["ici_loop"] == pytest.approx(7 / 8 * size / (50 * GB))


def test_a_group_over_two_dimensions_uses_the_links_of_both():
  grid = [Device(0, (x, y, 0)) for x in range(4) for y in range(4)]
  fabric = interconnect.Fabric(link_gbps=50.0, dims=(4, 4), wrap=(True, False), dcn_gbps=3.125)
  assert fabric.group_bandwidth(grid) == 3 * 50.0  # x wraps (2 links), y does not (1)
  assert fabric.group_bandwidth(grid[:4]) == 50.0  # x fixed at 0: a line along y


def test_a_collective_across_slices_is_costed_at_dcn_bandwidth():
  size = 64 * 2**20
  two_slices = [Device(0, (0, 0, 0)), Device(1, (0, 0, 0))]
  fabric = interconnect.fabric(aot_targets.CHIPS["v5e"], (4, 4), (True, True))
  crossing = hlo_collectives.Collective("all-reduce", size, ((0, 1),), count=1, in_loop=False)
  seconds = interconnect.step_seconds([crossing], two_slices, fabric, num_slices=2)
  assert seconds["dcn"] == pytest.approx(2 * (1 / 2) * size / (3.125 * GB)) and seconds["ici"] == 0
  # The TPU compiler hands cross-slice reductions to the multi-slice runtime as host sends: the same cost.
  text = ALL_GATHER.replace(
    "all-gather(%y), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}",
    'send(%y, %tok), is_host_transfer=true, frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}',
  )
  megascale = hlo_collectives.collectives(_hlo(text, loop="3"))
  assert [(c.kind, c.cross_slice, c.count) for c in megascale] == [("all-reduce", True, 3)]
  dcn = interconnect.step_seconds(megascale, two_slices, fabric, num_slices=2)["dcn_loop"]
  assert dcn == pytest.approx(3 * 2 * (1 / 2) * megascale[0].bytes / (3.125 * GB))


def test_a_group_spanning_slices_is_costed_within_then_across_them():
  members = _ring(4, 0) + _ring(4, 1)
  fabric = interconnect.Fabric(link_gbps=50.0, dims=(4, 1, 1), wrap=(True, False, False), dcn_gbps=5.0)
  seconds = interconnect.collective_seconds("all-reduce", 8e9, members, fabric, num_slices=2)
  assert seconds.ici == pytest.approx(2 * 3 / 4 * 8e9 / (100 * GB))
  assert seconds.dcn == pytest.approx(2 * 1 / 2 * (8e9 / 4) / (5 * GB))  # each chip sends its quarter across


@pytest.mark.parametrize("trip", ["known_trip_count", "condition"])
def test_a_loops_collectives_are_multiplied_by_its_trip_count(trip):
  known = ', backend_config={"known_trip_count":{"n":"12"}}' if trip == "known_trip_count" else ""
  found = hlo_collectives.collectives(_hlo(ALL_GATHER, loop="" if known else "12", trip=known))
  assert [(c.count, c.in_loop) for c in found] == [(12, True)]
  one = interconnect.step_seconds(
    hlo_collectives.collectives(_hlo(ALL_GATHER)), _ring(8), interconnect.fabric(aot_targets.CHIPS["v4"], (8,), (True,)), 1
  )
  twelve = interconnect.step_seconds(found, _ring(8), interconnect.fabric(aot_targets.CHIPS["v4"], (8,), (True,)), 1)
  assert twelve["ici_loop"] == pytest.approx(12 * one["ici_loop"])


def test_nested_loops_multiply_and_every_call_site_counts():
  inner = _hlo(ALL_GATHER, loop="4")
  outer = inner.replace("ENTRY %main", "%inner_main").replace("HloModule m\n", "") + (
    "%cond2 (p: (s32[])) -> pred[] {\n  %n = s32[] constant(3)\n  ROOT %lt = pred[] compare(%n, %n), direction=LT\n}\n"
    "ENTRY %main2 (a: f32[8]) -> (s32[]) {\n"
    "  %a = f32[8] parameter(0)\n"
    "  %w1 = (s32[]) while(%a), condition=%cond2, body=%inner_main\n"
    "  ROOT %c = (s32[]) call(%a), to_apply=%inner_main\n"
    "}\n"
  )
  found = hlo_collectives.collectives("HloModule m\n" + outer)
  assert [c.count for c in found] == [3 * 4 + 4]  # 3 runs of the 4-trip loop, plus one call of it


def test_replica_groups_in_iota_form():
  assert hlo_collectives.replica_groups("replica_groups=[2,4]<=[8], dimensions") == ((0, 1, 2, 3), (4, 5, 6, 7))
  assert hlo_collectives.replica_groups("replica_groups=[4,2]<=[2,4]T(1,0), x") == ((0, 4), (1, 5), (2, 6), (3, 7))
  assert hlo_collectives.replica_groups("source_target_pairs={{0,1},{1,0}}") == ((0, 1), (1, 0))
  assert hlo_collectives.replica_groups("replica_groups={}, to_apply=%add") == ()


def test_replica_groups_in_mesh_form():
  """libtpu 0.0.42 writes replica_groups=mesh[...] {axes}: the devices that differ only along those axes."""
  mesh = "replica_groups=mesh['axis_0'=4,'axis_1'=2] "
  assert hlo_collectives.replica_groups(mesh + "{'axis_0'}, dimensions={1}") == ((0, 2, 4, 6), (1, 3, 5, 7))
  assert hlo_collectives.replica_groups(mesh + "{'axis_1'}, x") == ((0, 1), (2, 3), (4, 5), (6, 7))
  assert hlo_collectives.replica_groups(mesh + "{'axis_0','axis_1'}, x") == (tuple(range(8)),)


def test_collectives_in_loops_hide_behind_the_layers_and_the_rest_add():
  base = dict(model_tflops=80.0, compiled_tflops=100.0, compiled_gbytes=10.0, peak_tflops=100.0, bandwidth_gbps=100.0)
  hidden = roofline.StepEstimate(**base, layers_share=0.9, comm=roofline.Communication(ici_loop=0.5))
  assert hidden.step_seconds == pytest.approx(1.0) and hidden.bound == "compute"
  exposed = roofline.StepEstimate(**base, layers_share=0.9, comm=roofline.Communication(ici_loop=1.5, dcn=2.0))
  assert exposed.step_seconds == pytest.approx(1.0 + (1.5 - 0.9) + 2.0) and exposed.bound == "DCN"
  assert exposed.lines()[-1] == "Estimate: 3.600 s per step, DCN bound, MFU 22.2%"
