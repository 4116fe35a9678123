"""bench/sass_budget.py, the static roofline of the CUDA GEMVs, measured on planted kernels whose answer is known.

A copy loop (one 16-byte load and store per iteration) must come out far below one instruction per byte; a loop
that spends 128 FFMAs on every 4-byte load must come out far over the 13-per-byte budget and FMA-bound. Needs nvcc
and cuobjdump (the CUDA toolkit here, or triton's bundled cuobjdump); skipped without them.
"""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("sass_budget", ROOT / "bench" / "sass_budget.py")
sb = importlib.util.module_from_spec(_spec)
sys.modules["sass_budget"] = sb  # dataclasses resolve annotations through the module
_spec.loader.exec_module(sb)

PLANTED = r"""
#include <cstdint>
__global__ void planted_copy(const uint4* __restrict__ src, uint4* __restrict__ dst, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) dst[i] = src[i];
}
__global__ void planted_fma(const float* __restrict__ src, float* __restrict__ dst, int n, float a, float b) {
  float acc = 0.f;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    float v = src[i];
#pragma unroll
    for (int k = 0; k < 128; ++k) v = fmaf(v, a, b);
    acc += v;
  }
  dst[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}
// A 4-stage cp.async pipeline: 3 iterations' 16-byte loads in flight while one is stored (one thread reads its own
// copies only, so no barrier). The wait must show up as DEPBAR.LE SB0, 0x2.
__global__ void planted_pipe(const uint4* __restrict__ src, uint4* __restrict__ dst, int n) {
  __shared__ __align__(16) uint4 buf[4][128];
  const int t = threadIdx.x;
  for (int s = 0; s < 3; ++s) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(&buf[s][t]));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a), "l"(src + s * 128 + t));
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
  for (int k = 0; k < n; ++k) {
    asm volatile("cp.async.wait_group 2;\n" ::: "memory");
    dst[k * 128 + t] = buf[k % 4][t];
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(&buf[(k + 3) % 4][t]));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a), "l"(src + (k + 3) * 128 + t));
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
}
"""

nvcc = sb.find_nvcc()
cuobjdump = sb.find_cuobjdump(nvcc)
pytestmark = pytest.mark.skipif(nvcc is None or cuobjdump is None, reason="needs nvcc and cuobjdump")


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> dict[str, "sb.Kernel"]:
    import subprocess

    d = tmp_path_factory.mktemp("planted")
    src = d / "planted.cu"
    src.write_text(PLANTED)
    obj, log = sb.compile_object(nvcc, src, ["90"], d)
    sass = subprocess.run([cuobjdump, "-sass", str(obj)], capture_output=True, text=True, check=True).stdout
    kernels = sb.parse_sass(sass)
    names = sb.demangle([k.mangled for k in kernels])
    regs = sb.parse_ptxas(log)
    out = {}
    for k, name in zip(kernels, names, strict=True):
        k.name = name
        k.regs, k.spill_bytes = regs[(k.mangled, k.arch)]
        out[name.split("(")[0]] = k
    return out


def measure(k, bytes_per_thread_iter: float) -> dict:
    hot, key = sb.hot_loops(k)
    assert hot is not None and key is None
    return sb.model(sb.count(sb.body(k, hot)), 32 * bytes_per_thread_iter, k.arch)


def test_copy_loop_is_far_under_one_instruction_per_byte(planted):
    m = measure(planted["planted_copy"], 16)  # one 16-byte load per thread and iteration
    assert m["counts"]["lsu"] == 2  # the LDG.128 and the STG.128
    assert 3 <= m["counts"]["issue"] <= 12  # load, store, index update, compare, branch (+ address math)
    assert m["instr_per_byte"] < 1.0
    assert m["pct_copy_bw"] == 100.0


def test_fma_loop_is_far_over_budget_and_fma_bound(planted):
    m = measure(planted["planted_fma"], 4)  # one float per thread and iteration, 128 FFMAs on it
    assert m["counts"]["fma"] >= 128
    assert m["instr_per_byte"] > 26  # twice the budget
    assert m["weighted_per_byte"] > 13
    assert m["bottleneck"] in ("issue", "fma")
    assert m["pct_copy_bw"] < 50


def test_in_flight_reads_the_pipeline_depth(planted):
    # the copy loop: one iteration's 16-byte load per thread in flight; at one CTA of 4 warps per SM that is 2 KB,
    # far under latency x bandwidth: latency-bound
    k = planted["planted_copy"]
    hot, _ = sb.hot_loops(k)
    m = measure(k, 16)
    sb.in_flight(m, k, hot, 32 * 16, 1, 128)
    assert m["iterations_in_flight"] == 1
    assert m["kb_in_flight_per_sm"] == 2.0
    # 2 KB x 132 SMs / 0.9 us = 0.30 TB/s: 10 % of the H100's 3.0 TB/s
    assert m["bottleneck"] == "latency" and 9.9 < m["pct_copy_bw"] < 10.1
    # the cp.async pipeline: wait_group 2 keeps 3 iterations in flight
    p = planted["planted_pipe"]
    loops = [lp for lp in sb.find_loops(p) if any(op.startswith("DEPBAR") for _, op, _ in sb.body(p, lp))]
    assert loops  # the compiler may unroll it into a main loop and a remainder: each waits the same way
    for lp in loops:
        mp = {"pct_copy_bw": 100.0, "bottleneck": "issue"}
        sb.in_flight(mp, p, lp, 32 * 16, 1, 128)
        assert mp["iterations_in_flight"] == 3
        assert mp["kb_in_flight_per_sm"] == 6.0


def test_spec_and_bytes_of_the_gemv_names():
    s = sb.spec_of("void kvk::(anonymous namespace)::gemv_inner_q_kernel<3, (kvk::QuantMode)0, 2, 1>(...)")
    assert (s.family, s.bits, s.mode, s.query_rows, s.vec, s.ring) == ("inner_q", 3, "sym", 8, True, False)
    r = sb.spec_of("void kvk::(anonymous namespace)::gemv_inner_q_kernel<4, (kvk::QuantMode)1, 1, 2>(...)")
    assert (r.bits, r.mode, r.query_rows, r.vec, r.ring) == (4, "asym", 4, True, True)
    w = sb.spec_of("void kvk::(anonymous namespace)::gemv_inner_q_kernel<2, (kvk::QuantMode)2, 1, 0>(...)")
    assert (w.vec, w.ring) == (False, False)
    # 16 rows x 4 blocks x (12 code bytes + one fp16 scale)
    assert sb.bytes_per_iteration(s) == 16 * 4 * (12 + 2)
    # the ring's head_dim-64 key kernel (loads 3): a ring kernel whose only modelled loop is the L = 64 tile
    r64 = sb.spec_of("void kvk::(anonymous namespace)::gemv_inner_q_kernel<2, (kvk::QuantMode)2, 1, 3>(...)")
    assert (r64.ring, r64.ring64, r.ring64) == (True, True, False)
    assert sb.is_preset(r64, "90")
    k = sb.spec_of("void kvk::(anonymous namespace)::gemv_kivi_kernel<2, 1, 16, 0>(...)")
    assert (k.family, k.bits, k.cpl, k.query_rows, k.vec, k.ring) == ("kivi", 2, 16, 4, False, False)
    kr = sb.spec_of("void kvk::(anonymous namespace)::gemv_kivi_kernel<1, 2, 16, 2>(...)")
    assert (kr.bits, kr.query_rows, kr.vec, kr.ring) == (1, 8, True, True)
    # the presets' rows: the ring, at 16 columns per lane and at 8 (head_dim 64 values)
    k8, k8r = sb.spec_of("gemv_kivi_kernel<2, 1, 8, 0>"), sb.spec_of("gemv_kivi_kernel<2, 1, 8, 2>")
    assert sb.is_preset(kr, "90") and not sb.is_preset(k, "90")
    assert sb.is_preset(k8r, "90") and not sb.is_preset(k8, "90")
    # 16 rows x 128 columns x 2 bits + 4 groups x (scale + zero) per row
    assert sb.bytes_per_iteration(k) == 16 * (128 * 2 / 8 + 4 * 4)
    # 64 columns: a register-load iteration is one k-step, a ring item two
    assert sb.bytes_per_iteration(k8) == 16 * (64 * 2 / 8 + 2 * 4)
    assert sb.bytes_per_iteration(k8r) == 2 * sb.bytes_per_iteration(k8)


def test_spec_and_bytes_of_the_lattice_gemvs():
    k = sb.spec_of("void kvk::(anonymous namespace)::gemv_lattice_k_kernel<(kvk::LatticeGrid)1, 128, 64, 2, true>(...)")
    assert (k.family, k.mode, k.bits, k.dim, k.group, k.query_rows, k.ring) == (
        "lattice_k",
        "EDEN2-64",
        3,
        128,
        64,
        8,
        True,
    )
    # one 16-token tile: 16 rows x (128 channels x 3 bits + one fp16 norm per group of 64)
    assert sb.bytes_per_iteration(k) == 16 * (48 + 2 * 2)
    # head_dim 64: a tile is 16 x (16 + 2 x 2) bytes; the loop's MMAs (4 k-steps x 1 n-tile per tile) say how many
    # tiles an iteration takes: the ring's items two, the register loads one
    k64 = sb.spec_of("gemv_lattice_k_kernel<(kvk::LatticeGrid)0, 64, 32, 1, true>")
    k64r = sb.spec_of("gemv_lattice_k_kernel<(kvk::LatticeGrid)0, 64, 32, 1, false>")
    assert sb.bytes_per_iteration(k64) == sb.bytes_per_iteration(k64r) == 16 * (16 + 2 * 2)
    assert sb.lattice_units(k64, 8) == 2 and sb.lattice_units(k64r, 4) == 1 and sb.lattice_units(k, 16) == 1
    for wrong in (0, 6):  # no MMA, or a partial tile's: the loop found is not the one the spec describes
        with pytest.raises(ValueError, match="not units of 4"):
            sb.lattice_units(k64, wrong)
    # the launched rows: the ring up to head_dim 128, register loads at 256
    assert sb.is_preset(k, "90") and sb.is_preset(k64, "90") and not sb.is_preset(k64r, "90")
    assert sb.is_preset(sb.spec_of("gemv_lattice_k_kernel<(kvk::LatticeGrid)0, 256, 32, 1, false>"), "90")
    v = sb.spec_of("void kvk::(anonymous namespace)::gemv_lattice_v_kernel<(kvk::LatticeGrid)3, 64, 1, true>(...)")
    assert (v.family, v.mode, v.bits, v.dim, v.norms_in_b, v.query_rows) == ("lattice_v", "EDEN4-256", 2, 64, True, 4)
    # one k-step: 16 tokens x (64 channels x 2 bits + the norm of their one group); value_unroll's 4 k-steps
    assert sb.bytes_per_iteration(v) == 16 * (16 + 2)
    assert sb.lattice_units(v, 4 * 4) == 4


def test_aqua_spec_and_shared_memory():
    assert sb.aqua_spec("void kvk::(anonymous namespace)::aqua_reconstruct_mma_kernel<true, 2>(...)") == ("bf16", 2)
    assert sb.aqua_spec("void kvk::(anonymous namespace)::aqua_reconstruct_mma_kernel<false, 1>(...)") == ("fp16", 1)
    assert sb.aqua_spec("kvk::(anonymous namespace)::aqua_reconstruct_f32_kernel(...)") is None
    # 3 stages x (64 + 128) rows x 64 bytes (> the 64 x 136 fp32 epilogue tile), + grid table and scale
    assert sb.aqua_smem_bytes(2) == 3 * 192 * 64 + (1024 + 128) * 4
    assert sb.aqua_smem_bytes(1) == 3 * 160 * 64 + (1024 + 128) * 4


def _aqua_row(wm: int, hmma: int = 32, issue: int = 64) -> "sb.AquaRow":
    loop = {"issue": issue, "alu": 0, "fma": 0, "imad": 0, "mio": 0, "lsu": 0, "hmma": hmma, "xu": 0}
    epi = {g: {**loop, "hmma": 0, "issue": 0} for g in (32, 64, 128)}  # a free epilogue
    return sb.AquaRow("k", "90", "bf16", wm, 128, 0, 4, loop, epi, 0)


def test_aqua_roofline_arithmetic():
    rows = [_aqua_row(1), _aqua_row(2)]
    m = sb.aqua_roofline(rows, 4096, 1024, 1024)
    assert (m["wm"], m["ctas"], m["warps_per_sm"]) == (2, 64 * 8, 16)
    assert m["flop"] == 2 * 4096 * 1024 * 1024
    # prev + W (fp16), 2-bit codes, fp16 norms of G 64, the fp32 output, the bias
    assert m["bytes"] == 2 * (4096 + 1024) * 1024 + 4096 * 1024 // 4 + 2 * 4096 * 16 + 4 * 4096 * 1024 + 4 * 1024
    # HMMA-bound CTAs: 4 warps x 32 tiles x 32 HMMA at the peak-equivalent rate, 4 CTAs on the busiest SM = the peak
    # FLOP rate over the CTAs' share (512 CTAs on 132 SMs: 3.88 per SM on average, 4 on the busiest)
    assert m["bound"] == "SM pipes (hmma)"
    assert abs(m["pct_peak"] - 100 * 512 / (132 * 4)) < 0.1
    # 128 tokens: 32-token tiles (32 CTAs of 2 warps: half of each SM's 4 sub-partitions)
    m = sb.aqua_roofline(rows, 128, 1024, 1024)
    assert (m["wm"], m["ctas"], m["active_sms"], m["warps_per_sm"]) == (1, 32, 32, 2)
    assert abs(m["pct_peak"] - 100 * 32 / 132 / 2) < 0.1


def test_spec_and_bytes_of_the_attention_tiles():
    # InnerQ store tiles <D, NT, key bits, mode, value bits, mode>: innerq_base at head_dim 128, 4 rows: 64 tokens
    k = sb.spec_of("void kvk::(anonymous namespace)::store_tiles_kernel<128, 1, 3, (kvk::QuantMode)0, 3, "
                   "(kvk::QuantMode)0>(kvk::DecodeAttentionParams, kvk::StoreTilesLaunch)")  # fmt: skip
    assert (k.family, k.bits, k.mode, k.vbits, k.vmode, k.query_rows, k.dim) == (
        "attn_store",
        3,
        "sym",
        3,
        "sym",
        4,
        128,
    )
    assert sb.bytes_per_iteration(k) == 2 * 64 * (128 * 3 / 8 + 2 * 128 / 32)
    # KIVI tiles <D, NT, key bits, value bits>, asym both: kivi2 at head_dim 128, 8 rows, 64 tokens a step; keys
    # 128 channels x 64 tokens x 2 bits + a scale and a zero per channel and 32 tokens, values the same transposed
    v = sb.spec_of("void kvk::(anonymous namespace)::kivi_tiles_kernel<128, 2, 2, 2>(kvk::DecodeAttentionParams, "
                   "kvk::StoreTilesLaunch)")  # fmt: skip
    assert (v.family, v.bits, v.mode, v.vbits, v.vmode, v.query_rows, v.dim) == (
        "attn_kivi",
        2,
        "asym",
        2,
        "asym",
        8,
        128,
    )
    assert sb.bytes_per_iteration(v) == 2 * (128 * 64 * 2 / 8 + 128 * 2 * 4)
    assert sb.is_preset(v, "90") and not sb.is_preset(v, "87")
    src = (sb.ROOT / "csrc" / "cuda" / "decode_attention_store.cu").read_text()
    assert re.search(r"constexpr int kKiviTok = 64;", src), "the KIVI tiles' step changed: update bytes_per_iteration"
    assert re.search(r"constexpr int tok_per_step\([^)]*\) \{ return 64; \}", src), (
        "the InnerQ tiles' step changed: update bytes_per_iteration"
    )


def test_attention_tile_bytes_and_shared_memory():
    # innerq_base at head_dim 128: 32 tokens x 128 channels x 3 bits + one fp16 scale per 32 values, keys and values
    keys, values = sb.ATTN_PRESETS["innerq_base"]
    assert keys.tile_bytes(128) + values.tile_bytes(128) == 2 * (32 * 128 * 3 / 8 + 2 * 128)
    keys, values = sb.ATTN_PRESETS["kivi2"]  # 2 bits, scale + zero
    assert keys.tile_bytes(64) == 32 * 64 * 2 / 8 + 4 * 64
    # key and value tiles [32][D + 4], queries [ROWS][D], probabilities [ROWS][32], 3 x ROWS row floats, key_x_scale
    # [D] (smem_floats); the table reads the 4-row instantiation
    assert sb.attention_smem_bytes(128, 16) == 4 * (2 * 32 * 132 + 16 * 128 + 16 * 32 + 48 + 128)
    assert sb.attention_smem_bytes(64) == 4 * (2 * 32 * 68 + 4 * 64 + 4 * 32 + 12 + 64) and sb.ATTN_ROWS == 4


def test_attention_markers_match_the_kernel_source():
    # the tile-class walk keys on source lines of csrc/cuda/decode_attention.cu: each pattern must still be there
    mk = sb.attention_markers(ROOT / "csrc" / "cuda" / sb.ATTN_SOURCE, ROOT / "csrc" / "kvkernels" / "quant.cuh")
    assert len(mk["keys"]) == 2 and len(mk["values"]) == 2 and not mk["keys"] & mk["values"]
    assert set(mk["cases"]) == {1, 2, 3, 4} and len(mk["score_fma"]) == 4
    assert mk["not_store"] and mk["hybrid"] and len(mk["xs_multiply"]) == 2
    # the unit kinds' own code never overlaps, nor does it overlap the window / invalid-token code
    assert mk["channel_only"] and mk["rows_only"] and not mk["channel_only"] & mk["rows_only"]
    assert not (mk["channel_only"] | mk["rows_only"]) & mk["not_store"]


LINED = """
        .text._Z1kv:
        /*0000*/                   S2R R0, SR_TID.X ;
.L_x_1:
        //## File "/x/k.cu", line 5
        /*0010*/                   ISETP.GE.AND P0, PT, R0, 0x10, PT ;
        /*0020*/               @P0 CALL.REL.NOINC `(.L_x_2) ;
        /*0030*/                   BRA `(.L_x_1) ;
.L_x_2:
        //## File "/x/k.cu", line 7
        /*0040*/                   EXIT ;
"""


def test_lined_sass_blocks_treat_a_local_call_as_a_loop_exit():
    (k,) = sb.parse_lined_sass(LINED, "90")
    assert k.chains[0x10] == (("k.cu", 5),) and k.labels == {".L_x_1": 0x10, ".L_x_2": 0x40}
    assert [(lp.start, lp.end) for lp in sb.find_loops(k)] == [(0x10, 0x30)]
    blocks = sb.basic_blocks(k)
    # @P0 CALL.REL.NOINC to a local label is ptxas's loop exit: a jump, not a call that returns
    assert sorted(blocks[0x10].succs) == [0x30, 0x40] and blocks[0x30].succs == [0x10]


SWITCH = """
        .text._Z1sv:
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   BRX R0 -0x20 ;
.L_x_1:
        /*0020*/                   IADD3 R1, R0, 0x1, RZ ;
        /*0030*/                   BRA `(.L_x_4) ;
.L_x_2:
        /*0040*/                   IADD3 R1, R0, 0x2, RZ ;
        /*0050*/                   BRA `(.L_x_4) ;
.L_x_3:
        /*0060*/                   IADD3 R1, R0, 0x3, RZ ;
.L_x_4:
        /*0070*/                   EXIT ;
"""


def test_lined_sass_blocks_follow_a_jump_table():
    # BRX (a switch compiled to a jump table) has no label: its cases are the labelled blocks nothing else reaches
    # (here .L_x_2 and .L_x_3; .L_x_1 is its fall-through), so a walk reaches every case
    (k,) = sb.parse_lined_sass(SWITCH, "90")
    blocks = sb.basic_blocks(k)
    assert sorted(blocks[0x0].succs) == [0x20, 0x40, 0x60] and blocks[0x60].succs == [0x70]
    assert sb._reach(blocks, 0x0, set(blocks), set()) == {0x0, 0x20, 0x40, 0x60, 0x70}
    # without the jump table's edges .L_x_2 and .L_x_3 were unreachable: the walk lost the 2-bit case of the fused
    # attention's staging this way (ptxas chose a jump table there on 2026-11-29)


def test_ring64_tiles_match_the_kernel_source():
    """sass_budget's bytes per L = 64 item follow ring64_rows<BITS>() in gemv_inner_q.cu: keep the two in step."""
    src = (sb.ROOT / "csrc" / "cuda" / "gemv_inner_q.cu").read_text()
    m = re.search(r"constexpr int ring64_rows\(\) \{\s*return BITS == 4 \? 16 : 32;", src)
    assert m, "ring64_rows<BITS>() changed: update sass_budget.ring64_tiles"
    assert [sb.ring64_tiles(b) for b in (1, 2, 3, 4)] == [2, 2, 2, 1]


def test_prebuilt_objects_are_reused_only_while_their_manifest_matches(tmp_path):
    # make sass-budget reuses .ci/nvcc_check.sh's objects; a stale one (any input changed) must be compiled again
    import subprocess

    rel = "csrc/cuda/gemv_kivi.cu"
    manifest = subprocess.run(
        ["bash", str(ROOT / ".ci" / "nvcc_check.sh"), "--manifest", rel], capture_output=True, text=True, check=True
    ).stdout
    lines = manifest.splitlines()
    assert lines[0].startswith("flags ") and lines[1] == "archs 80 87 90" and lines[2].endswith(rel)
    (tmp_path / "gemv_kivi.o").write_bytes(b"object")
    (tmp_path / "gemv_kivi.log").write_text("ptxas log")

    def reused(text: str, archs=("90", "87")):
        (tmp_path / "gemv_kivi.manifest").write_text(text)
        return sb.prebuilt_object(ROOT / rel, list(archs), tmp_path)

    assert reused(manifest) == (tmp_path / "gemv_kivi.o", "ptxas log")
    assert reused(manifest, ("90", "89")) is None  # an arch nvcc_check does not build
    header = next(line for line in lines if line.endswith(".cuh"))
    stale = [
        [("0" * 64 + header[64:]) if line == header else line for line in lines],  # a header changed since
        [line for line in lines if line != header],  # a header added since
        [*lines, "0" * 64 + "  csrc/kvkernels/removed.cuh"],  # a header removed since
        [line.replace("-O3", "-O2") for line in lines],  # other flags
    ]
    for text in stale:
        assert reused("\n".join(text)) is None
