"""Static roofline of the CUDA GEMVs, read from their compiled SASS (no GPU needed): `make sass-budget`.

For every kernel instantiation in csrc/cuda/gemv_*.cu this compiles the file for sm_90 and sm_87 (the setup.py
flags), finds the steady-state loop in the SASS (the innermost loop with the most HMMA, else the most LDG),
counts its instructions by class and divides by the compulsory bytes one iteration consumes (codes + scales +
zeros of the rows it covers, from the kernel's tiling, below; codes + norms for the lattice GEMVs, whose keys loop is
the 16-token tile loop, stores included). The model, per SM and clock:

    cycles(iteration of one warp) = max(issue / 4, ALU / 2, FMA / fma_rate, MIO / 1, LSU / 1, HMMA / hmma_rate)

issue = every instruction (4 schedulers); ALU = integer/logic (LOP3, SHF, PRMT, IADD3, ISETP, SEL, IMAD, ...: 64
lanes/SM, half rate); FMA = FFMA/FADD/FMUL/HFMA2/HADD2 (128 lanes on sm_90 and sm_87); MIO = LDS/STS/SHFL/LDSM
(one warp instruction per clock per SM); LSU = LDG/STG (likewise); HMMA m16n8k16 at A100's rate of one per two
clocks per SM (Hopper's mma.sync is faster; the conservative rate is used for both). The printed
"instr/byte" is thread-instructions per compulsory byte (issue slots only); "weighted" expresses the bottleneck
pipe in issue-slot equivalents (= 128 x cycles / bytes per warp-iteration), and the bandwidth ceiling follows:
bytes per SM-clock = bytes / cycles, against H100's ~3.0 TB/s copy bandwidth at 1.98 GHz on 132 SMs (11.5
B/clock/SM; 85% of it is ~13 weighted instr/byte) and Orin's ~190 GB/s at 1.3 GHz on 16 SMs.

aqua_reconstruct (csrc/cuda/aqua_reconstruct.cu) is a GEMM, not a GEMV: it gets its own table (instructions per
HMMA of the main loop, the lattice epilogue's instructions per round, registers, resident CTAs) and a whole-launch
model at a few shapes against the H100's dense tensor-core peak and HBM bandwidth (see AQUA_SOURCE below).

It is a model: latency, occupancy-limited memory parallelism, L2 behaviour and the CTA prologue (staging of the
query tile) are not in it. Every GPU session should measure the kernels and record model vs measured side by
side (bench/RESULTS.md).

Usage:
    python bench/sass_budget.py [--archs 90 87] [--markdown FILE] [--json FILE] [--no-gate]
Exit status 1 if an instantiation the presets use (sm_90, 1-2 n-tiles, aligned codes) is over --budget (10)
weighted instructions per byte (rows in KNOWN_OVER: over their recorded ceiling), or if an sm_90 hot loop touches
local memory (spills elsewhere are reported, not failed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["-std=c++17", "-O3", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr", "-Xptxas", "-v"]
SOURCES = ("gemv_inner_q.cu", "gemv_kivi.cu", "gemv_lattice.cu")

# ---- machine model --------------------------------------------------------------------------------------------------
# warp instructions per clock per SM, by pipe; bandwidth as bytes per clock per SM
MACHINES = {
    "90": {
        "name": "H100 SXM",
        "rates": {"issue": 4, "alu": 2, "fma": 4, "imad": 2, "mio": 1, "lsu": 1, "hmma": 0.5, "xu": 0.5},
        "copy_bytes_per_clk_sm": 3.0e12 / (1.98e9 * 132),
        "regs_per_sm": 65536,
        "max_warps": 64,
        "max_ctas": 32,
        "smem_per_sm": 228 * 1024,
    },
    "87": {
        "name": "Jetson Orin",
        "rates": {"issue": 4, "alu": 2, "fma": 4, "imad": 2, "mio": 1, "lsu": 1, "hmma": 0.25, "xu": 0.5},
        "copy_bytes_per_clk_sm": 190e9 / (1.3e9 * 16),
        "regs_per_sm": 65536,
        "max_warps": 48,
        "max_ctas": 16,
        "smem_per_sm": 164 * 1024,
    },
}

# opcode (before the first '.') -> pipe; anything else counts for issue only (control flow, S2R, NOP, ...)
PIPES = {
    "hmma": {"HMMA"},
    "fma": {"FFMA", "FADD", "FMUL", "FMNMX", "FSEL", "FSETP", "HFMA2", "HADD2", "HMUL2", "HSETP2", "HMNMX2", "FSWZADD"},
    "alu": {
        "LOP3",
        "LOP",
        "SHF",
        "SHL",
        "SHR",
        "PRMT",
        "IADD3",
        "IADD",
        "ISETP",
        "SEL",
        "LEA",
        "IMNMX",
        "IABS",
        "BMSK",
        "SGXT",
        "FLO",
        "POPC",
        "BREV",
        "MOV",
        "VIADD",
        "VIMNMX",
        "ICMP",
        "PLOP3",
        "P2R",
        "R2P",
    },
    "imad": {"IMAD", "IMUL"},
    "mio": {"LDS", "STS", "LDSM", "SHFL", "ATOMS", "MATCH", "VOTE", "REDUX"},
    "lsu": {"LDG", "STG", "LD", "ST", "ATOMG", "ATOM", "RED", "LDGSTS", "LDC", "LDL", "STL"},
    "xu": {"MUFU", "F2F", "F2I", "I2F", "F2FP", "I2FP", "FRND"},
}
PIPE_OF = {op: pipe for pipe, ops in PIPES.items() for op in ops}
SKIP = {"NOP"}  # alignment padding: never executed inside a loop body, but counted by cuobjdump after EXIT

BUDGET_DEFAULT = 10.0


# ---- tools -----------------------------------------------------------------------------------------------------------
def find_nvcc() -> str | None:
    for c in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if c and Path(c).exists():
            return c
    return None


def find_cuobjdump(nvcc: str | None) -> str | None:
    cands = [shutil.which("cuobjdump")]
    if nvcc:
        cands.append(str(Path(nvcc).resolve().parent / "cuobjdump"))
    cands += sorted(str(p) for p in ROOT.glob(".venv/lib/python3*/site-packages/triton/backends/nvidia/bin/cuobjdump"))
    try:  # triton's bundled copy in whichever interpreter runs this script
        import triton  # noqa: F401

        cands.append(str(Path(sys.modules["triton"].__file__).parent / "backends/nvidia/bin/cuobjdump"))
    except Exception:
        pass
    for c in cands:
        if c and Path(c).exists():
            return c
    return None


# ---- compile + parse ------------------------------------------------------------------------------------------------
@dataclass
class Kernel:
    arch: str
    mangled: str
    name: str = ""  # demangled
    regs: int = 0
    spill_bytes: int = 0
    instrs: list[tuple[int, str, str]] = field(default_factory=list)  # (address, opcode, full text)


def compile_object(nvcc: str, src: Path, archs: list[str], out_dir: Path) -> tuple[Path, str]:
    """nvcc -c src for archs; returns (object, ptxas log). Cached by a hash of the sources, flags and archs."""
    deps = [src, *sorted((ROOT / "csrc").rglob("*.cuh")), *sorted((ROOT / "csrc").rglob("*.h"))]
    key = hashlib.sha256(b"".join(p.read_bytes() for p in deps) + " ".join(FLAGS + archs).encode()).hexdigest()[:16]
    obj = out_dir / f"{src.stem}-{key}.o"
    log = obj.with_suffix(".log")
    if obj.exists() and log.exists():
        return obj, log.read_text()
    gencode = [x for a in archs for x in ("-gencode", f"arch=compute_{a},code=sm_{a}")]
    cmd = [nvcc, *FLAGS, "-I", str(ROOT / "csrc"), *gencode, "-c", str(src), "-o", str(obj)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed on {src}:\n{proc.stderr[-4000:]}")
    log.write_text(proc.stderr)
    return obj, proc.stderr


def parse_ptxas(log: str) -> dict[tuple[str, str], tuple[int, int]]:
    """(mangled, arch) -> (registers, spill bytes) from `-Xptxas -v` output."""
    out, fn, arch, spill = {}, None, None, 0
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for 'sm_(\d+)'", line)
        if m:
            fn, arch, spill = m.group(1), m.group(2), 0
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and fn:
            spill = int(m.group(1)) + int(m.group(2))
        m = re.search(r"Used (\d+) registers", line)
        if m and fn:
            out[(fn, arch)] = (int(m.group(1)), spill)
    return out


INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def parse_sass(text: str) -> list[Kernel]:
    kernels, arch, cur = [], None, None
    for line in text.splitlines():
        m = re.search(r"code for sm_(\d+)", line)
        if m:
            arch = m.group(1)
            continue
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = Kernel(arch=arch, mangled=m.group(1))
            kernels.append(cur)
            continue
        m = INSTR.search(line)
        if m and cur is not None:
            text_ = re.sub(r"^@!?U?P[T0-9]+\s+", "", m.group(2).strip())
            op = text_.split()[0] if text_ else ""
            cur.instrs.append((int(m.group(1), 16), op, text_))
    return kernels


def demangle(names: list[str]) -> list[str]:
    if not names:
        return []
    try:
        proc = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
        out = proc.stdout.splitlines()
        return out if len(out) == len(names) else names
    except (OSError, subprocess.CalledProcessError):
        return names


# ---- loops and counts ------------------------------------------------------------------------------------------
@dataclass
class Loop:
    start: int  # address of the first instruction (the back edge's target)
    end: int  # address of the back-edge branch

    def contains(self, other: Loop) -> bool:
        return (
            self.start <= other.start
            and other.end <= self.end
            and (self.start, self.end)
            != (
                other.start,
                other.end,
            )
        )


def find_loops(k: Kernel) -> list[Loop]:
    loops = set()
    for addr, op, text in k.instrs:
        if op.split(".")[0] == "BRA":
            m = re.search(r"0x([0-9a-f]+)", text)
            if m and int(m.group(1), 16) <= addr:
                loops.add((int(m.group(1), 16), addr))
    return [Loop(s, e) for s, e in sorted(loops)]


def body(k: Kernel, loop: Loop, exclude: list[Loop] = ()) -> list[tuple[int, str, str]]:
    return [
        i
        for i in k.instrs
        if loop.start <= i[0] <= loop.end and i[1] not in SKIP and not any(ex.start <= i[0] <= ex.end for ex in exclude)
    ]


def count(ins: list[tuple[int, str, str]]) -> dict[str, int]:
    c = {"issue": 0, "alu": 0, "fma": 0, "imad": 0, "mio": 0, "lsu": 0, "hmma": 0, "xu": 0}
    for _, op, _ in ins:
        c["issue"] += 1
        pipe = PIPE_OF.get(op.split(".")[0])
        if pipe:
            c[pipe] += 1
    c["fma"] += c["imad"]  # IMAD runs on the FMA-heavy half of the FP32 pipes: it also takes FMA issue capacity
    return c


def hot_loops(k: Kernel) -> tuple[Loop | None, Loop | None]:
    """(steady-state loop, key-tile loop or None).

    Candidates are the innermost loops with the most HMMA (else LDG). The steady-state loop is the one without
    stores (the main loop over the reduction dim); the key-tile loop is the one that also stores its results (the
    InnerQ tile loop for L = 128, where one iteration is a whole 16-row tile: its addressing and epilogue included).
    """
    loops = find_loops(k)
    innermost = [lp for lp in loops if not any(lp.contains(o) for o in loops)]

    def n(lp, opname):
        return sum(1 for _, op, _ in body(k, lp) if op.split(".")[0] == opname)

    marker = "HMMA" if any(op.startswith("HMMA") for _, op, _ in k.instrs) else "LDG"
    cands = [lp for lp in innermost if n(lp, marker) > 0]
    if not cands:
        return None, None
    most = max(n(lp, marker) for lp in cands)
    top = [lp for lp in cands if n(lp, marker) == most]
    steady = [lp for lp in top if n(lp, "STG") == 0] or top
    hot = min(steady, key=lambda lp: lp.end - lp.start)
    tiles = [lp for lp in top if n(lp, "STG") > 0 and lp != hot]
    key = min(tiles, key=lambda lp: lp.end - lp.start) if tiles else None
    return hot, key


def model(c: dict[str, int], bytes_per_warp_iter: float, arch: str) -> dict:
    m = MACHINES[arch]
    pipe_cycles = {p: c[p] / m["rates"][p] for p in m["rates"]}
    bottleneck = max(pipe_cycles, key=pipe_cycles.get)
    cycles = pipe_cycles[bottleneck]
    bw = bytes_per_warp_iter / cycles if cycles else float("inf")
    return {
        "counts": c,
        "bytes_per_warp_iter": bytes_per_warp_iter,
        "instr_per_byte": 32 * c["issue"] / bytes_per_warp_iter,
        "weighted_per_byte": 128 * cycles / bytes_per_warp_iter,
        "bottleneck": bottleneck,
        "pct_copy_bw": min(100.0, 100 * bw / m["copy_bytes_per_clk_sm"]),
    }


def ctas_per_sm(regs: int, threads: int, arch: str) -> int:
    m = MACHINES[arch]
    warps = (threads + 31) // 32
    regs_per_warp = ((max(regs, 1) + 7) // 8 * 8) * 32
    by_regs = m["regs_per_sm"] // (regs_per_warp * warps)
    return max(0, min(by_regs, m["max_warps"] // warps, m["max_ctas"]))


# ---- the GEMVs' tiling: compulsory bytes of one hot-loop iteration of one warp ------------------------------
@dataclass
class Spec:
    family: str
    bits: int
    mode: str
    ntiles: int
    vec: bool
    cpl: int = 0  # KIVI: columns per lane
    threads: int = 256
    dim: int = 0  # lattice: head_dim (keys) or channels per warp (values, DW)
    group: int = 0  # lattice keys: group size G (a template argument)
    norms_in_b: bool = False  # lattice values: G = D, the norm multiplies p in B (no HMUL2 in the loop)

    @property
    def query_rows(self) -> int:
        return 4 * self.ntiles


MODES = {"0": "sym", "1": "asym", "2": "hybrid"}
# lattice grid kind (kvk::LatticeGrid) -> (name, bits per value)
LATTICE_GRIDS = {"0": ("EDEN2-16", 2), "1": ("EDEN2-64", 3), "2": ("EDEN2-256", 4), "3": ("EDEN4-256", 2)}
LATTICE_PRESET_G = 64  # kvkernels.formats.lattice.LatticeConfig's default group size: the values' norm bytes


def spec_of(name: str) -> Spec | None:
    m = re.search(r"gemv_inner_q_kernel<(\d), \(kvk::QuantMode\)(\d), (\d), (true|false)>", name)
    if m:
        return Spec("inner_q", int(m.group(1)), MODES[m.group(2)], int(m.group(3)), m.group(4) == "true")
    m = re.search(r"gemv_kivi_kernel<(\d), (\d), (\d+), (true|false)>", name)
    if m:
        return Spec("kivi", int(m.group(1)), "asym", int(m.group(2)), m.group(4) == "true", cpl=int(m.group(3)))
    m = re.search(r"gemv_lattice_k_kernel<\(kvk::LatticeGrid\)(\d), (\d+), (\d+), (\d)>", name)
    if m:
        grid, bits = LATTICE_GRIDS[m.group(1)]
        return Spec("lattice_k", bits, grid, int(m.group(4)), False, dim=int(m.group(2)), group=int(m.group(3)))
    m = re.search(r"gemv_lattice_v_kernel<\(kvk::LatticeGrid\)(\d), (\d+), (\d), (true|false)>", name)
    if m:
        grid, bits = LATTICE_GRIDS[m.group(1)]
        nb = m.group(4) == "true"
        return Spec("lattice_v", bits, grid, int(m.group(3)), False, dim=int(m.group(2)), norms_in_b=nb)
    return None


def bytes_per_iteration(s: Spec, group_size: int = 32) -> float:
    """Codes + scales (+ zeros) one warp consumes per hot-loop iteration, at the presets' group size."""
    if s.family == "inner_q":  # 16 rows x 4 blocks of 32 values; one scale (and zero) per block at G = 32
        params = 2 + (0 if s.mode == "sym" else 2)
        return 16 * 4 * (32 * s.bits / 8 + params * 32 / group_size)
    if s.family == "lattice_k":  # one 16-token tile: whole rows of D channels, one fp16 norm per group
        return 16 * (s.dim * s.bits / 8 + 2 * s.dim / s.group)
    if s.family == "lattice_v":  # one k-step: 16 tokens x the warp's DW channels, their norms (at the preset G)
        return 16 * (s.dim * s.bits / 8 + 2 * (1 if s.norms_in_b else max(1, s.dim // LATTICE_PRESET_G)))
    cols = 8 * s.cpl  # KIVI: 16 rows (one k-step) x the warp's column tile; scale + zero per group of columns
    return 16 * (cols * s.bits / 8 + 4 * cols / group_size)


def key_tile_bytes(s: Spec) -> float:
    """InnerQ scores at head_dim 128: one 16-row tile = one chunk (the hot loop once + the tile loop's own work)."""
    return bytes_per_iteration(s)


# ---- the table ------------------------------------------------------------------------------------------------------
@dataclass
class Row:
    kernel: str
    arch: str
    spec: Spec
    regs: int
    spill: int
    ctas: int
    what: str  # "steady state" or "key tile (L=128)"
    m: dict
    preset: bool


# (bits, mode) of the InnerQ stores and KIVI stores the presets use (kvkernels/formats/, PRESETS)
PRESET_INNER_Q = {(3, "sym"), (2, "sym"), (2, "hybrid"), (4, "asym"), (1, "asym")}
PRESET_KIVI = {1, 2, 4}


# Preset rows over the budget today, with the ceiling CI holds them to (a regression fails; an improvement below the
# budget drops the row from the gate's list, say so in the commit). Why they are over: at 1 bit the fp16 scale and
# zero are half of the compulsory bytes, and the decode is still 2 (InnerQ) / 3 (KIVI) instructions per value pair;
# the InnerQ key tile adds a whole tile's addressing and epilogue to one chunk. Issue 16's note has the next levers.
# Every lattice instantiation is gated (all grids, head_dims and group sizes; the budget for the lattice
# GEMVs is the same 10).
KNOWN_OVER: dict[tuple, float] = {
    # (family, bits, mode, query rows, cols/lane, loop): ceiling
    ("inner_q", 1, "asym", 4, 0, "key tile (L=128)"): 11.5,
    ("inner_q", 1, "asym", 8, 0, "steady state"): 12.0,
    ("inner_q", 1, "asym", 8, 0, "key tile (L=128)"): 14.5,
    ("inner_q", 2, "hybrid", 8, 0, "key tile (L=128)"): 10.5,
    ("kivi", 1, "asym", 4, 16, "steady state"): 10.7,
    ("kivi", 1, "asym", 8, 16, "steady state"): 12.0,
    ("kivi", 1, "asym", 4, 8, "steady state"): 13.3,
    ("kivi", 1, "asym", 8, 8, "steady state"): 14.9,
    ("kivi", 2, "asym", 8, 8, "steady state"): 10.3,
    # Lattice (family, grid, query rows, D or channels per warp, G (keys), norms in B (values), loop). At head_dim 64
    # a keys tile / values k-step has half the bytes of head_dim 128 while its fixed work stays (row pointers, loop,
    # norms, the 16-token output stores), and 8 query rows double the MMAs (HMMA 4 per 16x16 tile of codes at 2
    # bits); EDEN2-64's 6-bit indices cost 2.5 ALU per lookup (the 16th index is gathered from three words), and
    # values pay one PRMT per A register to put two tokens in it (a looked-up half2 holds two channels of one token).
    # SmolLM2 (head_dim 64, GQA 3) decodes at 4 query rows, inside the budget.
    ("lattice_k", "EDEN2-16", 8, 64, 32, False, "steady state"): 10.8,
    ("lattice_k", "EDEN2-16", 8, 64, 64, False, "steady state"): 11.0,
    ("lattice_k", "EDEN4-256", 8, 64, 32, False, "steady state"): 10.8,
    ("lattice_k", "EDEN4-256", 8, 64, 64, False, "steady state"): 11.0,
    ("lattice_k", "EDEN2-64", 8, 64, 32, False, "steady state"): 10.7,
    ("lattice_k", "EDEN2-64", 8, 64, 64, False, "steady state"): 11.0,
    ("lattice_v", "EDEN2-16", 8, 64, 0, False, "steady state"): 10.3,
    ("lattice_v", "EDEN4-256", 8, 64, 0, False, "steady state"): 11.2,
    ("lattice_v", "EDEN4-256", 8, 64, 0, True, "steady state"): 10.3,
    ("lattice_v", "EDEN2-64", 4, 64, 0, False, "steady state"): 10.4,
    ("lattice_v", "EDEN2-64", 4, 64, 0, True, "steady state"): 10.1,
    ("lattice_v", "EDEN2-64", 8, 64, 0, False, "steady state"): 10.9,
    ("lattice_v", "EDEN2-64", 8, 64, 0, True, "steady state"): 10.6,
    ("lattice_v", "EDEN2-64", 8, 128, 0, False, "steady state"): 10.5,
}


def row_key(r: Row) -> tuple:
    if r.spec.family.startswith("lattice"):  # mode = grid name; dim = head_dim (keys) / channels per warp (values)
        return (r.spec.family, r.spec.mode, r.spec.query_rows, r.spec.dim, r.spec.group, r.spec.norms_in_b, r.what)
    return (r.spec.family, r.spec.bits, r.spec.mode, r.spec.query_rows, r.spec.cpl, r.what)


def kivi_has_vec(s: Spec) -> bool:
    """KIVI's 64-bit code loads exist for 4 bits at 16 columns per lane only (two words per row)."""
    return s.bits == 4 and s.cpl == 16


def is_preset(s: Spec, arch: str) -> bool:
    if arch != "90" or s.ntiles > 2:
        return False
    if s.family == "inner_q":
        return (s.bits, s.mode) in PRESET_INNER_Q and (s.vec or s.bits == 4)
    if s.family.startswith("lattice"):  # every grid, head_dim and group size (issue: <= 10 for the lattice GEMVs)
        return True
    return s.bits in PRESET_KIVI and (s.vec or not kivi_has_vec(s))


def analyse(kernels: list[Kernel]) -> list[Row]:
    rows = []
    for k in kernels:
        s = spec_of(k.name)
        if s is None or k.arch not in MACHINES:
            continue
        hot, key = hot_loops(k)
        if hot is None:
            raise RuntimeError(f"no steady-state loop found in {k.name} (sm_{k.arch})")
        ctas = ctas_per_sm(k.regs, s.threads, k.arch)
        m = model(count(body(k, hot)), bytes_per_iteration(s), k.arch)
        m["loop"] = [hex(hot.start), hex(hot.end)]
        m["local_memory_in_loop"] = sum(1 for _, op, _ in body(k, hot) if op.split(".")[0] in ("LDL", "STL"))
        rows.append(Row(k.name, k.arch, s, k.regs, k.spill_bytes, ctas, "steady state", m, is_preset(s, k.arch)))
        if key is not None:
            mt = model(count(body(k, key)), key_tile_bytes(s), k.arch)
            mt["loop"] = [hex(key.start), hex(key.end)]
            mt["local_memory_in_loop"] = sum(1 for _, op, _ in body(k, key) if op.split(".")[0] in ("LDL", "STL"))
            rows.append(
                Row(k.name, k.arch, s, k.regs, k.spill_bytes, ctas, "key tile (L=128)", mt, is_preset(s, k.arch))
            )
    return rows


def table(rows: list[Row]) -> str:
    head = (
        "| kernel | bits | mode / grid | query rows | sm | loop | regs | CTAs/SM | instr/iter | bytes/iter | "
        "instr/byte | weighted | bound by | modelled % of copy BW | preset |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in sorted(
        rows,
        key=lambda r: (
            r.spec.family,
            -int(r.arch),
            r.spec.bits,
            r.spec.mode,
            r.spec.ntiles,
            not r.spec.vec,
            r.spec.cpl,
            r.spec.dim,
            r.spec.group,
            r.spec.norms_in_b,
            r.what,
        ),
    ):
        s = r.spec
        if s.family == "lattice_k":
            fam = f"gemv_lattice_k (D {s.dim}, G {s.group})"
        elif s.family == "lattice_v":
            fam = f"gemv_lattice_v (channels/warp {s.dim}{', G = D' if s.norms_in_b else ''})"
        else:
            fam = "gemv_inner_q" if s.family == "inner_q" else f"gemv_kivi (cols/lane {s.cpl})"
        narrow = not s.vec and (s.bits != 4 if s.family == "inner_q" else s.family == "kivi" and kivi_has_vec(s))
        fam += ", 32-bit loads" if narrow else ""
        lines.append(
            f"| {fam} | {s.bits} | {s.mode} | {s.query_rows} | {r.arch} | {r.what} | {r.regs}"
            f"{' SPILL' if r.spill else ''} | {r.ctas} | {r.m['counts']['issue']} | "
            f"{r.m['bytes_per_warp_iter'] / 32:.1f} | "
            f"{r.m['instr_per_byte']:.1f} | {r.m['weighted_per_byte']:.1f} | {r.m['bottleneck']} | "
            f"{r.m['pct_copy_bw']:.0f}% | {'yes' if r.preset else ''} |"
        )
    return head + "\n".join(lines) + "\n"


# ---- aqua_reconstruct: a GEMM with a lattice epilogue ------------------------------------------------------------
# Not a GEMV: its compulsory bytes do not bound it, the tensor cores may. Per instantiation (dtype, WM: 32 x WM tokens
# x 128 channels per CTA, 2 x WM warps of 32 x 64) the hot loop is one 32-input-channel tile per warp (2 k16 steps x
# 2 x 8 HMMA); its instructions per HMMA and pipe cycles come from the SASS as above. The epilogue's item loop (one
# per (grid, G) variant: a round is 8 (token, group) items per warp) is measured the same way, and a whole launch is
# modelled per SM as throughput: every CTA's loop and epilogue instructions summed per pipe (resident CTAs overlap
# one's epilogue with the others' MMAs), HMMA at the rate H100's dense peak implies (990 TFLOP/s / (4096 FLOP x
# 1.98 GHz x 132 SMs) = 0.925 m16n8k16 per clock per SM; the GEMV table's 0.5 is A100's), the busiest SM's share
# of the CTAs, against the HBM time of the compulsory bytes. Not modelled: latency (a CTA's cp.async pipeline is 2
# tiles deep), the prologue, mma.sync not reaching wgmma's peak on Hopper, L2. A static model, unverified on a GPU.
AQUA_SOURCE = "aqua_reconstruct.cu"
HMMA_FLOP = 2 * 16 * 8 * 16
H100 = {"clock": 1.98e9, "sms": 132, "tc_flops": 990e12, "hbm": 3.35e12}
HMMA_PEAK_RATE = H100["tc_flops"] / (HMMA_FLOP * H100["clock"] * H100["sms"])  # ~0.925 per clock per SM


def aqua_spec(name: str) -> tuple[str, int] | None:
    """(operand dtype, WM) of an aqua_reconstruct tensor-core instantiation."""
    m = re.search(r"aqua_reconstruct_mma_kernel<(true|false), (\d)>", name)
    return ("bf16" if m.group(1) == "true" else "fp16", int(m.group(2))) if m else None


def aqua_smem_bytes(wm: int) -> int:
    """Dynamic shared memory of a CTA (mirrors csrc/cuda/aqua_reconstruct.cu): the 3-stage pipeline of
    (32 WM + 128) rows x 64 bytes, or the fp32 epilogue tile 32 WM x 136 if larger; the grid table and scale."""
    bm = 32 * wm
    return max(3 * (bm + 128) * 64, bm * 136 * 4) + (1024 + 128) * 4


@dataclass
class AquaRow:
    kernel: str
    arch: str
    dtype: str
    wm: int
    regs: int
    spill: int
    ctas: int  # resident CTAs per SM (registers, shared memory, warps)
    loop: dict  # pipe counts of one hot-loop iteration of one warp
    epilogue: dict[int, dict]  # G -> pipe counts of one item round of one warp (the largest over the four grids)
    local_memory_in_loop: int

    @property
    def warps(self) -> int:
        return 2 * self.wm


def aqua_rows(kernels: list[Kernel]) -> list[AquaRow]:
    rows = []
    for k in kernels:
        spec = aqua_spec(k.name)
        if spec is None or k.arch not in MACHINES:
            continue
        hot, _ = hot_loops(k)
        if hot is None or count(body(k, hot))["hmma"] == 0:
            raise RuntimeError(f"no HMMA loop found in {k.name} (sm_{k.arch})")
        loops = find_loops(k)
        epi: dict[int, dict] = {}
        for lp in (lp for lp in loops if not any(lp.contains(o) for o in loops)):
            b = body(k, lp)
            shfl = sum(1 for _, op, _ in b if op.split(".")[0] == "SHFL")
            if shfl:  # 2 butterfly stages x G / 4 values per lane: G = 2 x the shuffles of a round
                c = count(b)
                g = 2 * shfl
                if g not in epi or c["issue"] > epi[g]["issue"]:
                    epi[g] = c
        dtype, wm = spec
        threads = 64 * wm
        smem_limit = MACHINES[k.arch]["smem_per_sm"] // (aqua_smem_bytes(wm) + 1024)  # + 1 KB reserved per CTA
        ctas = min(ctas_per_sm(k.regs, threads, k.arch), smem_limit)
        local = sum(1 for _, op, _ in body(k, hot) if op.split(".")[0] in ("LDL", "STL"))
        rows.append(AquaRow(k.name, k.arch, dtype, wm, k.regs, k.spill_bytes, ctas, count(body(k, hot)), epi, local))
    return rows


def pipe_cycles(c: dict, arch: str, hmma_rate: float) -> dict[str, float]:
    rates = {**MACHINES[arch]["rates"], "hmma": hmma_rate}
    return {p: c[p] / rates[p] for p in rates}


def aqua_roofline(rows: list[AquaRow], T: int, C: int, C_in: int, C_in2: int = 0, G: int = 64, bits: int = 2) -> dict:
    """Modelled H100 time of aqua_reconstruct [T, C] with fp16 / bf16 operands (the launcher's tile choice), as
    fractions of the dense tensor-core peak and of HBM bandwidth; see the comment above AQUA_SOURCE."""
    sms = H100["sms"]
    wm = 1 if -(-T // 64) * -(-C // 128) < sms else 2  # as launch_aqua_reconstruct
    r = next(x for x in rows if x.arch == "90" and x.wm == wm)
    bm = 32 * wm
    ctas = -(-T // bm) * -(-C // 128)
    tiles = -(-C_in // 32) + -(-C_in2 // 32)
    rounds = bm * (128 // G) // (r.warps * 8)  # epilogue rounds per warp
    per_cta = {p: r.warps * (tiles * r.loop[p] + rounds * r.epilogue[G][p]) for p in r.loop}
    # a warp runs on one of the SM's 4 sub-partitions (each its own issue slot and tensor core): fewer than 4
    # resident warps leave the rest idle
    warps_per_sm = min(-(-ctas // sms), r.ctas) * r.warps
    cyc = {p: c / min(1.0, warps_per_sm / 4) for p, c in pipe_cycles(per_cta, "90", HMMA_PEAK_RATE).items()}
    bound = max(cyc, key=cyc.get)
    t_compute = -(-ctas // sms) * cyc[bound] / H100["clock"]
    flop = 2 * T * C * (C_in + C_in2)
    nbytes = 2 * (T + C) * (C_in + C_in2) + T * C * bits // 8 + 2 * T * (C // G) + 4 * T * C + 4 * C
    t_mem = nbytes / H100["hbm"]
    t = max(t_compute, t_mem)
    return {
        "wm": wm,
        "ctas": ctas,
        "active_sms": min(ctas, sms),
        "warps_per_sm": warps_per_sm,
        "flop": flop,
        "bytes": nbytes,
        "t_compute": t_compute,
        "t_mem": t_mem,
        "bound": f"SM pipes ({bound})" if t_compute >= t_mem else "HBM",
        "pct_peak": 100 * flop / t / H100["tc_flops"],
        "pct_hbm": 100 * nbytes / t / H100["hbm"],
        "hmma_share": cyc["hmma"] / cyc[bound],
    }


AQUA_SHAPES = {  # name: (T, C, C_in, C_in2, G): Llama-8B keys / values (C 1024) and SmolLM2 keys (C 192)
    "C 1024 keys, T 4096": (4096, 1024, 1024, 0, 64),
    "C 1024 values (C_in2 1024), T 4096": (4096, 1024, 1024, 1024, 64),
    "C 1024 keys, T 128": (128, 1024, 1024, 0, 64),
    "C 1024 values, T 128": (128, 1024, 1024, 1024, 64),
    "C 1024, rank 64, T 4096": (4096, 1024, 64, 0, 64),
    "C 192 keys, T 128": (128, 192, 192, 0, 64),
}


def aqua_table(rows: list[AquaRow]) -> str:
    out = [
        "| kernel | sm | regs | CTAs/SM | loop instr | HMMA | instr/HMMA | issue clk | HMMA clk (90: 0.925, 87: "
        "0.25 per clk) | bound by | epilogue instr per round, G 32 / 64 / 128 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (-int(r.arch), r.dtype, r.wm)):
        cyc = pipe_cycles(r.loop, r.arch, HMMA_PEAK_RATE if r.arch == "90" else MACHINES[r.arch]["rates"]["hmma"])
        epi = " / ".join(str(r.epilogue[g]["issue"]) if g in r.epilogue else "-" for g in (32, 64, 128))
        out.append(
            f"| {r.dtype}, {32 * r.wm} x 128 tile ({r.warps} warps) | {r.arch} | {r.regs}{' SPILL' if r.spill else ''}"
            f" | {r.ctas} | {r.loop['issue']} | {r.loop['hmma']} | {r.loop['issue'] / r.loop['hmma']:.2f} | "
            f"{cyc['issue']:.1f} | {cyc['hmma']:.1f} | {max(cyc, key=cyc.get)} | {epi} |"
        )
    roof = [
        "",
        "| shape (fp16 / bf16, H100 model) | tile | CTAs (warps / SM) | FLOP | bytes | compute us | HBM us | bound | "
        "% of 990 TF | % of HBM |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    if any(r.arch == "90" for r in rows):
        for name, (T, C, C_in, C_in2, G) in AQUA_SHAPES.items():
            m = aqua_roofline(rows, T, C, C_in, C_in2, G)
            roof.append(
                f"| {name} | {32 * m['wm']} x 128 | {m['ctas']} ({m['warps_per_sm']}) | {m['flop'] / 1e9:.2f} G | "
                f"{m['bytes'] / 1e6:.1f} M |"
                f" {1e6 * m['t_compute']:.2f} | {1e6 * m['t_mem']:.2f} | {m['bound']} | {m['pct_peak']:.0f}% | "
                f"{m['pct_hbm']:.0f}% |"
            )
    return "\n".join(out + roof) + "\n"


def build(archs: list[str], sources: list[Path], out_dir: Path, jobs: int = 2) -> list[Kernel]:
    nvcc = find_nvcc()
    cuobjdump = find_cuobjdump(nvcc)
    if nvcc is None or cuobjdump is None:
        raise FileNotFoundError(f"sass_budget needs nvcc and cuobjdump (found nvcc={nvcc}, cuobjdump={cuobjdump})")
    out_dir.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(jobs) as ex:
        built = list(ex.map(lambda s: compile_object(nvcc, s, archs, out_dir), sources))
    kernels = []
    for obj, log in built:
        regs = parse_ptxas(log)
        sass = subprocess.run([cuobjdump, "-sass", str(obj)], capture_output=True, text=True, check=True).stdout
        ks = parse_sass(sass)
        for k, name in zip(ks, demangle([k.mangled for k in ks]), strict=True):
            k.name = name
            k.regs, k.spill_bytes = regs.get((k.mangled, k.arch), (0, 0))
        kernels += ks
    return kernels


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", nargs="+", default=["90", "87"], choices=sorted(MACHINES))
    ap.add_argument("--budget", type=float, default=BUDGET_DEFAULT, help="weighted instr/byte gate (presets, sm_90)")
    ap.add_argument("--markdown", type=Path, help="also write the table here")
    ap.add_argument("--json", type=Path, help="also write every row as JSON here")
    ap.add_argument("--build-dir", type=Path, default=ROOT / "build" / "sass_budget")
    ap.add_argument("--no-gate", action="store_true", help="print the table, never fail")
    ap.add_argument("--presets-only", action="store_true", help="table of the gated rows only (bench/README.md)")
    a = ap.parse_args(argv)
    try:
        kernels = build(a.archs, [ROOT / "csrc" / "cuda" / s for s in (*SOURCES, AQUA_SOURCE)], a.build_dir)
    except FileNotFoundError as e:
        print(f"sass_budget: SKIP ({e})")
        return 0
    rows = analyse(kernels)
    aqua = aqua_rows(kernels)
    out = table([r for r in rows if r.preset] if a.presets_only else rows)
    out += "\naqua_reconstruct (a GEMM: instructions per HMMA, not per byte; static model, unverified on a GPU):\n\n"
    out += aqua_table(aqua)
    print(out)
    if a.markdown:
        a.markdown.write_text(out)
    if a.json:
        a.json.write_text(
            json.dumps([{**r.__dict__, "spec": r.spec.__dict__} for r in rows] + [r.__dict__ for r in aqua], indent=1)
        )
    preset = [r for r in rows if r.preset]
    known = [r for r in preset if row_key(r) in KNOWN_OVER and r.m["weighted_per_byte"] > a.budget]
    over = [r for r in preset if r.m["weighted_per_byte"] > KNOWN_OVER.get(row_key(r), a.budget)]
    spills = [r for r in rows if r.spill]
    local = [r for r in rows if r.m["local_memory_in_loop"]]
    print(
        f"{len(rows)} rows; preset rows (sm_90) within {a.budget} weighted instr/byte: {len(preset) - len(known)}"
        f" of {len(preset)}; known over (held to a ceiling): {len(known)}; new or worse: {len(over)}"
    )
    for r in known:
        print(
            f"  known over: {r.kernel} sm_{r.arch} {r.what}: {r.m['weighted_per_byte']:.1f}"
            f" (ceiling {KNOWN_OVER[row_key(r)]})"
        )
    for r in over:
        print(f"  OVER: {r.kernel} sm_{r.arch} {r.what}: {r.m['weighted_per_byte']:.1f}")
    # Spills outside the hot loops (staging, planning of a pass) cost a few local loads per CTA; inside a hot loop
    # they would cost bandwidth on every iteration: that fails.
    print(
        f"kernel/arch pairs with spills: {len({(r.kernel, r.arch) for r in spills})} (outside the hot loops: "
        f"{len({(r.kernel, r.arch) for r in spills}) - len({(r.kernel, r.arch) for r in local})})"
    )
    for r in local:
        print(f"  LOCAL MEMORY IN HOT LOOP: {r.kernel} sm_{r.arch} {r.what}: {r.m['local_memory_in_loop']} LDL/STL")
    aqua_local = [r for r in aqua if r.local_memory_in_loop]
    for r in aqua_local:
        print(f"  LOCAL MEMORY IN HOT LOOP: {r.kernel} sm_{r.arch}: {r.local_memory_in_loop} LDL/STL")
    fail = bool(over) or any(r.arch == "90" for r in local + aqua_local)
    return 0 if a.no_gate or not fail else 1


if __name__ == "__main__":
    sys.exit(main())
