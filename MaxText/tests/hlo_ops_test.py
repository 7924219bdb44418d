"""The computation part of train_compile.py's estimate: a compiled program's operations read from HLO text (hlo_ops),
each costed by the compiler's cycles or its own roofline, one after another, against figures computed by hand."""

import pytest

from MaxText.aot import hlo_ops, roofline

PEAK = 100e12  # FLOP/s
BANDWIDTH = 1e12  # bytes/s

# A matmul fusion: [1024, 4096] x [4096, 8192] in bf16 (a dot inside a fusion, as XLA emits it).
MATMUL = """
%fused_matmul (p0: bf16[1024,4096], p1: bf16[4096,8192]) -> bf16[1024,8192] {
  %p0 = bf16[1024,4096]{1,0} parameter(0)
  %p1 = bf16[4096,8192]{1,0} parameter(1)
  ROOT %d = bf16[1024,8192]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
MATMUL_FLOPS = 2 * 1024 * 8192 * 4096
MATMUL_BYTES = 2 * (1024 * 4096 + 4096 * 8192 + 1024 * 8192)
# A norm-like fusion: reads and writes [1024, 8192] in f32, one multiply per element.
SCALE = """
%fused_scale (q0: f32[1024,8192]) -> f32[1024,8192] {
  %q0 = f32[1024,8192]{1,0} parameter(0)
  ROOT %m = f32[1024,8192]{1,0} multiply(%q0, %q0)
}
"""
SCALE_BYTES = 2 * 4 * 1024 * 8192


def _program(entry_body: str, computations: str = MATMUL + SCALE, loop: int = 0, cycles: str = "") -> str:
  """An HLO module whose entry runs `entry_body`, directly or (loop > 0) as the body of a while loop."""
  config = f', backend_config={{"window_config":{{"estimated_cycles":"{cycles}"}}}}' if cycles else ""
  body = entry_body.replace("$CYCLES", config)
  if not loop:
    return f"HloModule m\n{computations}\nENTRY %main (a: bf16[1024,4096], b: bf16[4096,8192]) -> f32[8] {{\n{body}\n}}\n"
  return (
    f"HloModule m\n{computations}\n"
    f"%body (w: (s32[], bf16[1024,4096], bf16[4096,8192])) -> (s32[]) {{\n"
    "  %w = (s32[], bf16[1024,4096], bf16[4096,8192]) parameter(0)\n"
    "  %a = bf16[1024,4096]{1,0} get-tuple-element(%w), index=1\n"
    "  %b = bf16[4096,8192]{1,0} get-tuple-element(%w), index=2\n"
    f"{body}\n  ROOT %t = (s32[]) tuple(%a)\n}}\n"
    "%cond (c: (s32[])) -> pred[] {\n"
    "  %c = (s32[]) parameter(0)\n"
    "  %i = s32[] get-tuple-element(%c), index=0\n"
    f"  %n = s32[]{{:T(128)}} constant({loop})\n"
    "  ROOT %lt = pred[] compare(%i, %n), direction=LT\n}\n"
    "ENTRY %main (a: bf16[1024,4096], b: bf16[4096,8192]) -> (s32[]) {\n"
    "  %a = bf16[1024,4096]{1,0} parameter(0)\n"
    "  %init = (s32[]) tuple(%a)\n"
    "  ROOT %loop = (s32[]) while(%init), condition=%cond, body=%body\n}\n"
  )


ENTRY = (
  "  %a = bf16[1024,4096]{1,0} parameter(0)\n"
  "  %b = bf16[4096,8192]{1,0} parameter(1)\n"
  "  %mm = bf16[1024,8192]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused_matmul$CYCLES\n"
  "  %f = f32[1024,8192]{1,0} convert(%mm)\n"
  "  %s = f32[1024,8192]{1,0} fusion(%f), kind=kLoop, calls=%fused_scale"
)


def test_a_matmul_fusion_has_its_dots_flops_and_its_operands_and_results_bytes():
  found = {op.name: op for op in hlo_ops.ops(_program(ENTRY))}
  assert found["mm"].flops == MATMUL_FLOPS and found["mm"].bytes == MATMUL_BYTES
  assert found["s"].flops == 1024 * 8192 and found["s"].bytes == SCALE_BYTES
  assert found["mm"].compute_bound(PEAK, BANDWIDTH) and not found["s"].compute_bound(PEAK, BANDWIDTH)
  assert set(found) == {"mm", "f", "s"}  # parameters are free


def test_operations_add_up_one_after_another():
  """The memory-bound ops do not hide behind the matmul: the time is the sum of each op's roofline, more than the
  roofline of the totals (which overlaps all memory traffic with all FLOPs)."""
  found = hlo_ops.ops(_program(ENTRY))
  serial = hlo_ops.serial_time(found, PEAK, BANDWIDTH)
  matmul = max(MATMUL_FLOPS / PEAK, MATMUL_BYTES / BANDWIDTH)
  convert = (2 + 4) * 1024 * 8192 / BANDWIDTH  # bf16 in, f32 out (its element count at peak is far less)
  scale = SCALE_BYTES / BANDWIDTH
  assert serial.seconds == pytest.approx(matmul + convert + scale)
  assert serial.compute_bound == pytest.approx(matmul)
  totals = max(serial.flops / PEAK, serial.bytes / BANDWIDTH)  # the matmul's FLOPs outlast every byte
  assert serial.seconds - totals == pytest.approx(convert + scale, rel=0.01)  # less their elementwise FLOPs


def test_the_compilers_cycle_estimate_is_preferred_at_the_chips_clock():
  found = {op.name: op for op in hlo_ops.ops(_program(ENTRY, cycles="2000000"))}
  assert found["mm"].cycles == 2_000_000
  assert found["mm"].seconds(PEAK, BANDWIDTH, clock_hz=1e9) == pytest.approx(2e-3)
  assert found["mm"].seconds(PEAK, BANDWIDTH) == pytest.approx(MATMUL_FLOPS / PEAK)  # no clock: the roofline
  serial = hlo_ops.serial_time(list(found.values()), PEAK, BANDWIDTH, clock_hz=1e9)
  assert serial.from_cycles == pytest.approx(2e-3)


@pytest.mark.parametrize("trip", [1, 7])
def test_a_loops_operations_are_multiplied_by_its_trip_count(trip):
  body = (
    "  %mm = bf16[1024,8192]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused_matmul\n"
    "  %f = f32[1024,8192]{1,0} convert(%mm)\n"
    "  %s = f32[1024,8192]{1,0} fusion(%f), kind=kLoop, calls=%fused_scale"
  )
  found = {op.name: op for op in hlo_ops.ops(_program(body, loop=trip))}
  assert found["mm"].count == trip and found["mm"].in_loop
  serial = hlo_ops.serial_time(list(found.values()), PEAK, BANDWIDTH)
  assert serial.flops == trip * (MATMUL_FLOPS + 2 * 1024 * 8192)
  assert serial.in_loops == pytest.approx(serial.seconds)


def test_a_dot_written_as_a_convolution_counts_the_kernel_positions_that_meet_the_input():
  """The TPU compiler writes x[tokens, emb] @ w[emb, heads, head_dim] as a convolution with the heads as a spatial
  dimension padded 15 on each side: each output head meets exactly one kernel position."""
  convolution = """
%fused_conv (x: bf16[2048,2048,1], w: bf16[2048,16,128]) -> bf16[2048,16,128] {
  %x = bf16[2048,2048,1]{2,1,0} parameter(0)
  %w = bf16[2048,16,128]{2,1,0} parameter(1)
  ROOT %c = bf16[2048,16,128]{2,1,0} convolution(%x, %w), window={size=16 pad=15_15 rhs_reversal=1}, dim_labels=bf0_i0o->b0f
}
%fused_out (h: bf16[2048,16,128], w: bf16[16,128,2048]) -> bf16[2048,2048,1] {
  %h = bf16[2048,16,128]{2,1,0} parameter(0)
  %w = bf16[16,128,2048]{2,1,0} parameter(1)
  ROOT %c = bf16[2048,2048,1]{2,1,0} convolution(%h, %w), window={size=16}, dim_labels=b0f_0io->bf0
}
"""
  entry = (
    "  %x = bf16[2048,2048,1]{2,1,0} parameter(0)\n"
    "  %w = bf16[2048,16,128]{2,1,0} parameter(1)\n"
    "  %wo = bf16[16,128,2048]{2,1,0} parameter(2)\n"
    "  %k = bf16[2048,16,128]{2,1,0} fusion(%x, %w), kind=kOutput, calls=%fused_conv\n"
    "  %o = bf16[2048,2048,1]{2,1,0} fusion(%k, %wo), kind=kOutput, calls=%fused_out"
  )
  found = {op.name: op for op in hlo_ops.ops(_program(entry, computations=convolution))}
  assert found["k"].flops == 2 * 2048 * 2048 * 16 * 128  # the key projection: tokens x emb x heads x head_dim
  assert found["o"].flops == 2 * 2048 * 2048 * 16 * 128  # the output projection contracts heads x head_dim


def test_a_fusion_that_slices_a_stacked_weight_reads_the_slice_and_an_update_in_place_writes_the_update():
  computations = """
%slice_layer (stack: bf16[48,512,512], i: s32[]) -> bf16[1,512,512] {
  %stack = bf16[48,512,512]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = bf16[1,512,512]{2,1,0} dynamic-slice(%stack, %i, %z, %z), dynamic_slice_sizes={1,512,512}
}
%update_layer (stack: bf16[48,512,512], i: s32[], new: bf16[1,512,512]) -> bf16[48,512,512] {
  %stack = bf16[48,512,512]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %new = bf16[1,512,512]{2,1,0} parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = bf16[48,512,512]{2,1,0} dynamic-update-slice(%stack, %new, %i, %z, %z)
}
"""
  entry = (
    "  %stack = bf16[48,512,512]{2,1,0} parameter(0)\n"
    "  %i = s32[] parameter(1)\n"
    "  %layer = bf16[1,512,512]{2,1,0} fusion(%stack, %i), kind=kLoop, calls=%slice_layer\n"
    "  %back = bf16[48,512,512]{2,1,0} fusion(%stack, %i, %layer), kind=kLoop, calls=%update_layer"
  )
  found = {op.name: op for op in hlo_ops.ops(_program(entry, computations=computations))}
  layer = 2 * 512 * 512
  assert found["layer"].bytes == layer + 4 + layer  # the slice read, the index, the slice written
  assert found["back"].bytes == 4 + layer + layer  # the index and the update read, the update written


def test_a_grouped_matmul_kernel_is_costed_by_its_real_rows_and_other_kernels_are_opaque():
  """jax.lax.ragged_dot compiles to a Mosaic kernel: 2048 token rows by 16 experts' [512, 256] weights costs
  2 x 2048 x 512 x 256, not 16 times that. A flash-attention kernel's FLOPs are not in the text."""
  entry = (
    "  %sizes = s32[16]{0} parameter(0)\n"
    "  %x = bf16[2048,512]{1,0} parameter(1)\n"
    "  %w = bf16[16,512,256]{2,1,0} parameter(2)\n"
    '  %r = bf16[2048,256]{1,0} custom-call(%sizes, %x, %w), custom_call_target="tpu_custom_call", '
    'frontend_attributes={ragged_dot_tiling="128,512,256"}\n'
    "  %q = bf16[16,2048,128]{2,1,0} parameter(3)\n"
    '  %fa = bf16[16,2048,128]{2,1,0} custom-call(%q, %q, %q), custom_call_target="tpu_custom_call"\n'
    '  %cb = bf16[16,2048,128]{2,1,0} custom-call(%fa), custom_call_target="ConcatBitcast"'
  )
  found = {op.name: op for op in hlo_ops.ops(_program(entry, computations=""))}
  assert found["r"].flops == 2 * 2048 * 512 * 256 and not found["r"].opaque
  assert found["fa"].opaque and found["fa"].bytes == 4 * 2 * 16 * 2048 * 128
  assert "cb" not in found  # layout bookkeeping moves nothing
  serial = hlo_ops.serial_time(list(found.values()), PEAK, BANDWIDTH)
  assert serial.opaque == 1 and serial.opaque_bytes_seconds == pytest.approx(found["fa"].bytes / BANDWIDTH)
  # The buffer is sized for the worst case; the config's tokens x top-k are the rows the kernel runs.
  routed = {op.name: op for op in hlo_ops.ops(_program(entry, computations=""), routed_rows=512)}
  assert routed["r"].flops == 2 * 512 * 512 * 256


def test_megablox_kernels_are_costed_by_their_own_estimate_over_the_routed_rows():
  """gmm (buffer rows 2048 x K 512 -> N 256) and tgmm (the weight gradient, 16 groups of 512 x 256): their
  cost_estimate counts every buffer row; the routed rows (512) are a quarter of them."""
  estimate = 2 * 2048 * 512 * 256
  kernel = f'custom_call_target="tpu_custom_call", backend_config={{"cost_estimate":{{"flops":"{estimate}"}}}}'
  entry = (
    "  %x = bf16[2048,512]{1,0} parameter(0)\n"
    "  %w = bf16[16,512,256]{2,1,0} parameter(1)\n"
    "  %g = bf16[2048,256]{1,0} parameter(2)\n"
    f"  %gmm.3 = bf16[2048,256]{{1,0}} custom-call(%x, %w), {kernel}\n"
    f"  %tgmm = bf16[16,512,256]{{2,1,0}} custom-call(%x, %g), {kernel}"
  )
  found = {op.name: op for op in hlo_ops.ops(_program(entry, computations=""), routed_rows=512)}
  assert found["gmm.3"].flops == found["tgmm"].flops == estimate / 4
  assert not found["gmm.3"].opaque and not found["tgmm"].opaque
  assert {op.name: op.flops for op in hlo_ops.ops(_program(entry, computations=""))} == {"gmm.3": estimate, "tgmm": estimate}


def test_a_grouped_weight_gradient_written_dense_over_its_groups_is_marked_with_its_cost_by_routed_rows():
  """ragged_dot's weight gradient compiles to a convolution of the rows masked per group (pred[16, 2048]) with the
  experts as a dilated spatial dimension: each of the 16 groups multiplies all 2048 rows, which the TPU runs."""
  computations = """
%grouped_weight_gradient (dout: bf16[2048,256], x: bf16[2048,512], mask: pred[16,2048]) -> bf16[16,512,256] {
  %x = bf16[2048,512]{1,0} parameter(1)
  %mask = pred[16,2048]{1,0} parameter(2)
  %xm = bf16[16,2048,512]{2,1,0} broadcast(%x), dimensions={1,2}
  %dout = bf16[2048,256]{1,0} parameter(0)
  %dm = bf16[16,2048,256]{2,1,0} broadcast(%dout), dimensions={1,2}
  ROOT %c = bf16[16,512,256]{2,1,0} convolution(%xm, %dm), window={size=16 stride=15 lhs_dilate=16}, dim_labels=0fb_0io->0bf
}
"""
  entry = (
    "  %dout = bf16[2048,256]{1,0} parameter(0)\n"
    "  %x = bf16[2048,512]{1,0} parameter(1)\n"
    "  %mask = pred[16,2048]{1,0} parameter(2)\n"
    "  %dw = bf16[16,512,256]{2,1,0} fusion(%dout, %x, %mask), kind=kOutput, calls=%grouped_weight_gradient"
  )
  found = hlo_ops.ops(_program(entry, computations=computations), routed_rows=512)
  (dw,) = found
  assert dw.dense_groups == (16, 2048)
  assert dw.flops == 2 * 16 * 2048 * 512 * 256  # every group over every row: what the convolution computes
  serial = hlo_ops.serial_time(found, PEAK, BANDWIDTH, routed_rows=512)
  assert serial.dense_groups == pytest.approx(serial.seconds)
  assert serial.dense_groups_by_rows == pytest.approx(serial.seconds * 512 / (16 * 2048))


def test_collectives_and_asynchronous_copies_are_not_the_tensorcores_time():
  computations = """
%all-reduce-scatter (p: bf16[4096]) -> bf16[1024] {
  %p = bf16[4096]{0} parameter(0)
  ROOT %rs = bf16[1024]{0} reduce-scatter(%p), replica_groups={{0,1,2,3}}, dimensions={0}
}
"""
  entry = (
    "  %p = bf16[4096]{0} parameter(0)\n"
    "  %ag = bf16[16384]{0} all-gather(%p), replica_groups={{0,1,2,3}}, dimensions={0}\n"
    "  %rs = bf16[1024]{0} fusion(%p), kind=kCustom, calls=%all-reduce-scatter\n"
    "  %cs = (bf16[4096]{0}, bf16[4096]{0}, u32[]) copy-start(%p)\n"
    "  %cd = bf16[4096]{0} copy-done(%cs)\n"
    "  %c = bf16[4096]{0} copy(%cd)"
  )
  found = hlo_ops.ops(_program(entry, computations=computations))
  assert [op.name for op in found] == ["c"] and found[0].bytes == 2 * 2 * 4096


def test_the_estimate_takes_the_operations_sum_not_the_roofline_of_the_totals():
  """A step of a 1 s matmul and a 0.5 s memory-bound fusion takes 1.5 s, with the collectives on top."""
  serial = hlo_ops.SerialTime(seconds=1.5, compute_bound=1.0, in_loops=1.5, flops=100e12, bytes=0.7e12)
  base = dict(model_tflops=80.0, compiled_tflops=100.0, compiled_gbytes=700.0, peak_tflops=100.0, bandwidth_gbps=1e3)
  step = roofline.StepEstimate(
    **base,
    operations_seconds=serial.seconds,
    compute_bound_seconds=serial.compute_bound,
    layers_share=1.0,
    comm=roofline.Communication(dcn=0.5),
  )
  assert step.computation_seconds == pytest.approx(1.5) and step.memory_bound_seconds == pytest.approx(0.5)
  assert step.step_seconds == pytest.approx(2.0) and step.mfu == pytest.approx(80 / (2.0 * 100))
  assert step.bound == "compute"
  assert step.lines()[-1] == "Estimate: 2.000 s per step, compute bound, MFU 40.0%"
  without_operations = roofline.StepEstimate(**base, comm=roofline.Communication(dcn=0.5))
  assert without_operations.step_seconds == pytest.approx(1.5)  # max(1 s of FLOPs, 0.7 s of bytes) + 0.5
