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

decode_attention_fused (csrc/cuda/decode_attention.cu) has runtime switches instead of instantiations: its 32-token
tile loop is walked as a control-flow graph from nvdisasm's line info, per preset tile class (see ATTN_SOURCE below),
in a third table.

It is a model: latency, occupancy-limited memory parallelism, L2 behaviour and the CTA prologue (staging of the
query tile) are not in it. Every GPU session should measure the kernels and record model vs measured side by
side (bench/RESULTS.md).

Usage:
    python bench/sass_budget.py [--archs 90 87] [--markdown FILE] [--json FILE] [--no-gate]
Exit status 1 if an instantiation the presets use (sm_90, 1-2 n-tiles, aligned codes) is over --budget (10)
weighted instructions per byte (rows in KNOWN_OVER: over their recorded ceiling), or if an sm_90 hot loop touches
local memory (spills elsewhere are reported, not failed); also if a decode_attention_fused preset tile (sm_90) is over
its ATTN_CEILING, missing, or touches local memory.
"""

from __future__ import annotations

import argparse
import dataclasses
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
SOURCES = ("gemv_inner_q.cu", "gemv_kivi.cu", "gemv_lattice.cu", "decode_attention_store.cu")

# ---- machine model --------------------------------------------------------------------------------------------------
# DRAM load latency under load, for the memory-parallelism ceiling (in_flight below): calibrated on the first GPU run
# (H200, bench/RESULTS.md): the InnerQ key GEMV, one iteration's loads in flight per warp (no prefetch), 16 warps per
# SM, streamed at 2.22 TB/s (3-bit sym, 896 bytes per warp-iteration) and 2.94 TB/s (4-bit asym, 1280): Little's law
# gives 0.85 and 0.92 us. Orin's is not measured; the same value is used.
LOAD_LATENCY_S = 0.9e-6
# warp instructions per clock per SM, by pipe; bandwidth as bytes per clock per SM
MACHINES = {
    "90": {
        "name": "H100 SXM",
        "rates": {"issue": 4, "alu": 2, "fma": 4, "imad": 2, "mio": 1, "lsu": 1, "hmma": 0.5, "xu": 0.5},
        "copy_bytes_per_clk_sm": 3.0e12 / (1.98e9 * 132),
        "clock": 1.98e9,
        "latency_s": LOAD_LATENCY_S,
        "regs_per_sm": 65536,
        "max_warps": 64,
        "max_ctas": 32,
        "smem_per_sm": 228 * 1024,
    },
    "87": {
        "name": "Jetson Orin",
        "rates": {"issue": 4, "alu": 2, "fma": 4, "imad": 2, "mio": 1, "lsu": 1, "hmma": 0.25, "xu": 0.5},
        "copy_bytes_per_clk_sm": 190e9 / (1.3e9 * 16),
        "clock": 1.3e9,
        "latency_s": LOAD_LATENCY_S,
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
    # from nvdisasm -gi only (decode_attention): address -> inline chain ((file, line), innermost first), labels,
    # addresses of predicated instructions
    chains: dict[int, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    labels: dict[str, int] = field(default_factory=dict)
    predicated: set[int] = field(default_factory=set)


PREBUILT_DIR = ROOT / "build" / "nvcc_check"


def object_inputs(src: Path) -> list[Path]:
    """What an object compiled from src depends on: src and every csrc header (the key of both object caches)."""
    return [src, *sorted((ROOT / "csrc").rglob("*.cuh")), *sorted((ROOT / "csrc").rglob("*.h"))]


def prebuilt_object(src: Path, archs: list[str], prebuilt_dir: Path = PREBUILT_DIR) -> tuple[Path, str] | None:
    """The object .ci/nvcc_check.sh compiled from src, if its manifest shows it was built from exactly today's
    inputs: the same flags, at least these archs, and the same sha256 for src and for every csrc header (no more, no
    fewer files). None otherwise. The object may hold more archs than asked for: build() keeps only those asked."""
    obj, log, manifest = (prebuilt_dir / f"{src.stem}{ext}" for ext in (".o", ".log", ".manifest"))
    if not (obj.exists() and log.exists() and manifest.exists()):
        return None
    flags, built_archs, hashes = None, set(), {}
    for line in manifest.read_text().splitlines():
        head, _, rest = line.partition(" ")
        if head == "flags":
            toks = rest.split()
            flags, i = [], 0
            while i < len(toks):  # drop the include path and the gencodes: compared through archs
                if toks[i] in ("-I", "-gencode"):
                    i += 2
                    continue
                flags.append(toks[i])
                i += 1
        elif head == "archs":
            built_archs = set(rest.split())
        elif line.strip():
            digest, _, path = line.partition("  ")
            hashes[(ROOT / path.strip()).resolve()] = digest
    deps = object_inputs(src)
    if flags != FLAGS or not set(archs) <= built_archs or set(hashes) != {d.resolve() for d in deps}:
        return None
    if any(hashlib.sha256(d.read_bytes()).hexdigest() != hashes[d.resolve()] for d in deps):
        return None
    return obj, log.read_text()


def compile_object(nvcc: str, src: Path, archs: list[str], out_dir: Path) -> tuple[Path, str]:
    """nvcc -c src for archs; returns (object, ptxas log). Cached by a hash of the sources, flags and archs."""
    deps = object_inputs(src)
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


def instr_text(raw: str) -> tuple[str, str]:
    """(instruction without its guard predicate, opcode) of one disassembled instruction."""
    text_ = re.sub(r"^@!?U?P[T0-9]+\s+", "", raw.strip())
    return text_, (text_.split()[0] if text_ else "")


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
            text_, op = instr_text(m.group(2))
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
            target = int(m.group(1), 16) if m else None
            if target is None and k.labels:  # nvdisasm: BRA `(.L_x_12)
                m = re.search(r"\(([.$\w]+)\)", text)
                target = k.labels.get(m.group(1)) if m else None
            if target is not None and target <= addr:
                loops.add((target, addr))
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


def op_count(k: Kernel, lp: Loop, opname: str) -> int:
    """Instructions of loop lp whose opcode (before the first '.') is opname."""
    return sum(1 for _, op, _ in body(k, lp) if op.split(".")[0] == opname)


def hot_loops(k: Kernel) -> tuple[Loop | None, Loop | None]:
    """(steady-state loop, key-tile loop or None).

    Candidates are the innermost loops with the most HMMA (else LDG). The steady-state loop is the one without
    stores (the main loop over the reduction dim); the key-tile loop is the one that also stores its results (the
    InnerQ tile loop for L = 128, where one iteration is a whole 16-row tile: its addressing and epilogue included).
    """
    loops = find_loops(k)
    innermost = [lp for lp in loops if not any(lp.contains(o) for o in loops)]

    marker = "HMMA" if any(op.startswith("HMMA") for _, op, _ in k.instrs) else "LDG"
    cands = [lp for lp in innermost if op_count(k, lp, marker) > 0]
    if not cands:
        return None, None
    most = max(op_count(k, lp, marker) for lp in cands)
    top = [lp for lp in cands if op_count(k, lp, marker) == most]
    steady = [lp for lp in top if op_count(k, lp, "STG") == 0] or top
    hot = min(steady, key=lambda lp: lp.end - lp.start)
    tiles = [lp for lp in top if op_count(k, lp, "STG") > 0 and lp != hot]
    key = min(tiles, key=lambda lp: lp.end - lp.start) if tiles else None
    return hot, key


def masked_steps_loop(k: Kernel, hot: Loop) -> Loop | None:
    """The InnerQ attention tiles' second step loop, or None: steps below every row's causal limit without a caller's
    mask (decode at q_len 1: every step) run a loop without masking code, the steady state (hot_loops takes the smaller
    of two loops with the same HMMA); the others (a caller's mask, a longer query's last steps) run the same step
    with the masks. Its row is printed with the kernel's (not with --presets-only), outside the instructions-per-byte
    gate (a rarer path, whose extra work is the mask; its count holds both mask branches, the caller's and the causal
    one, of which a step runs one); local memory in it still fails the gate. The steady state is told apart by size,
    not by content: a ptxas that moved the masking code out of the loop would swap them (the rows would show it)."""
    loops = find_loops(k)
    innermost = [lp for lp in loops if not any(lp.contains(o) for o in loops) and lp != hot]
    same = [lp for lp in innermost if op_count(k, lp, "HMMA") == op_count(k, hot, "HMMA")]
    return max(same, key=lambda lp: lp.end - lp.start) if same else None


def ring64_tiles(bits: int) -> int:
    """16-row tiles per ring item of the InnerQ key GEMV at head_dim 64: ring64_rows<BITS>() / 16 (gemv_inner_q.cu)."""
    return 1 if bits == 4 else 2


def half_tile_loop(k: Kernel, hot: Loop, key: Loop | None) -> Loop | None:
    """The InnerQ key-tile loop at head_dim 64 (L = 64: the ring's items of ring64_tiles half-chunk tiles), or None:
    besides the steady-state and L = 128 key-tile loops, the innermost loop that stores its results and holds the most
    HMMA (2 blocks per tile, against the chunk's 4; the one-tile loop that takes a store's last tiles holds half as
    many below 4 bits, and the general tiles' tail stores nothing inside its loop). With zero points the kernel has two
    such tile-pair loops, one that checks each store for query rows past the last and one for passes without them
    (every q_len-1 decode at GQA 4 or 8): of equal HMMA counts the shorter one, i.e. the latter, is taken. So do the
    L = 128 key tiles (hot_loops takes the shorter as the key tile): loops with the steady state's or the key tile's
    HMMA count are not candidates."""
    loops = find_loops(k)
    innermost = [lp for lp in loops if not any(lp.contains(o) for o in loops) and lp not in (hot, key)]
    taken = {op_count(k, lp, "HMMA") for lp in (hot, key) if lp is not None}
    cands = [
        lp
        for lp in innermost
        if op_count(k, lp, "HMMA") > 0 and op_count(k, lp, "HMMA") not in taken and op_count(k, lp, "STG") > 0
    ]
    return max(cands, key=lambda lp: (op_count(k, lp, "HMMA"), lp.start - lp.end)) if cands else None


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
    vbits: int = 0  # attn_store: the value store's bits and mode (bits / mode are the key store's)
    vmode: str = ""
    ring: bool = False  # inner_q / kivi / lattice_k: codes and scales / norms through a cp.async ring
    ring64: bool = False  # inner_q: the kLoadRing64 kernel (keys at head_dim 64 below 4 bits, two-tile ring items)

    @property
    def query_rows(self) -> int:
        return 4 * self.ntiles


MODES = {"0": "sym", "1": "asym", "2": "hybrid"}
# decode_attention_fused's tensor-core tiles: InnerQ layouts (store_tiles_kernel), KIVI layouts (kivi_tiles_kernel)
ATTN_TILES = ("attn_store", "attn_kivi")
# lattice grid kind (kvk::LatticeGrid) -> (name, bits per value)
LATTICE_GRIDS = {"0": ("EDEN2-16", 2), "1": ("EDEN2-64", 3), "2": ("EDEN2-256", 4), "3": ("EDEN4-256", 2)}
LATTICE_PRESET_G = 64  # kvkernels.formats.lattice.LatticeConfig's default group size: the values' norm bytes


def spec_of(name: str) -> Spec | None:
    m = re.search(r"gemv_inner_q_kernel<(\d), \(kvk::QuantMode\)(\d), (\d), (\d)>", name)
    if m:  # the last argument is the code loads: 0 32-bit words, 1 16-byte to registers, 2 the cp.async ring, 3 the
        # ring's head_dim-64 key kernel
        loads = int(m.group(4))
        bits, mode, nt = int(m.group(1)), MODES[m.group(2)], int(m.group(3))
        return Spec("inner_q", bits, mode, nt, loads > 0, ring=loads >= 2, ring64=loads == 3)
    m = re.search(r"gemv_kivi_kernel<(\d), (\d), (\d+), (\d)>", name)
    if m:  # the same loads argument (1: 8-byte loads to registers, 4 bits only)
        loads = int(m.group(4))
        return Spec("kivi", int(m.group(1)), "asym", int(m.group(2)), loads > 0, cpl=int(m.group(3)), ring=loads == 2)
    m = re.search(r"store_tiles_kernel<(\d+), (\d), (\d), \(kvk::QuantMode\)(\d), (\d), \(kvk::QuantMode\)(\d)>", name)
    if m:  # decode_attention_fused's store tiles: <D, NT, key bits, mode, value bits, mode>
        return Spec(
            "attn_store",
            int(m.group(3)),
            MODES[m.group(4)],
            int(m.group(2)),
            False,
            threads=128,
            dim=int(m.group(1)),
            vbits=int(m.group(5)),
            vmode=MODES[m.group(6)],
        )
    m = re.search(r"kivi_tiles_kernel<(\d+), (\d), (\d), (\d)>", name)
    if m:  # decode_attention_fused's KIVI tiles: <D, NT, key bits, value bits>, asym both
        return Spec(
            "attn_kivi",
            int(m.group(3)),
            "asym",
            int(m.group(2)),
            False,
            threads=128,
            dim=int(m.group(1)),
            vbits=int(m.group(4)),
            vmode="asym",
        )
    m = re.search(r"gemv_lattice_k_kernel<\(kvk::LatticeGrid\)(\d), (\d+), (\d+), (\d), (true|false)>", name)
    if m:  # the last argument: whole tiles through the keys' code ring
        grid, bits = LATTICE_GRIDS[m.group(1)]
        ring = m.group(5) == "true"
        return Spec(
            "lattice_k", bits, grid, int(m.group(4)), False, dim=int(m.group(2)), group=int(m.group(3)), ring=ring
        )
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
    if s.family in ATTN_TILES:  # one warp step: keys and values of the step's tokens (D channels each)
        tok = 64  # tok_per_step / kKiviTok in csrc/cuda/decode_attention_store.cu (every tile: 64 since 2026-11-29)
        kparams = 2 + (0 if s.mode == "sym" else 2)
        vparams = 2 + (0 if s.vmode == "sym" else 2)
        keys = tok * (s.dim * s.bits / 8 + kparams * s.dim / group_size)
        values = s.dim * tok * (s.vbits / 8 + vparams / group_size)
        return keys + values
    if s.family == "lattice_k":  # one 16-token tile: whole rows of D channels, one fp16 norm per group
        return 16 * (s.dim * s.bits / 8 + 2 * s.dim / s.group)
    if s.family == "lattice_v":  # one k-step: 16 tokens x the warp's DW channels, their norms (at the preset G)
        return 16 * (s.dim * s.bits / 8 + 2 * (1 if s.norms_in_b else max(1, s.dim // LATTICE_PRESET_G)))
    cols = 8 * s.cpl  # KIVI: 16 rows (one k-step) x the warp's column tile; scale + zero per group of columns
    steps = 2 if s.ring and s.cpl == 8 else 1  # a 64-column store's ring item is two k-steps (gemv_kivi.cu)
    return steps * 16 * (cols * s.bits / 8 + 4 * cols / group_size)


def lattice_units(s: Spec, hmma: int) -> int:
    """How many of bytes_per_iteration's units (keys: 16-token tiles, values: k-steps) a lattice loop iteration
    takes, counted by its MMAs (dim / 16 x n-tiles per unit): keys two tiles per ring item at head_dim 64
    (key_ring_tiles in gemv_lattice.cu), values value_unroll k-steps."""
    per_unit = s.dim // 16 * s.ntiles
    if hmma == 0 or hmma % per_unit:
        raise ValueError(f"{hmma} HMMA in the loop, not units of {per_unit}")
    return hmma // per_unit


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
    what: str  # "steady state", "key tile (L=128)", "key tile (L=64)" or "masked steps" (attention tiles)
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
    ("inner_q", 1, "asym", 4, 0, "key tile (L=128)"): 10.9,
    # the cp.async ring (issue 16's loads in flight) reads each step back from shared memory: at 8 query rows the
    # 2- and 3-bit key tiles and the 1-bit loops went 0.1-0.7 over (still 100 % modelled: 10 is the margin budget)
    ("inner_q", 1, "asym", 4, 0, "steady state"): 10.5,
    # 8 query rows: B's columns are the 8 rows and the hi / lo halves two more k-steps into one accumulator since
    # 2026-11-29 (a later session; block_mma's kdup, as the attention tiles'), no FADD of the halves before each fold,
    # 4 a block: the 2-bit sym key tiles went 10.3 / 10.8 -> 9.9 / 9.9 (L = 128 / 64) and 3 sym at L = 128 10.6 -> 10.0,
    # within the budget; 2 hybrid 11.0 / 13.1 -> 10.2 / 12.2, 3 sym at L = 64 11.0 -> 10.6, 1 asym 14.2 / 17.2 / 12.1 ->
    # 12.8 / 15.9 / 10.9 (L = 128 / 64 / steady state). Earlier: 3 sym / 1 asym at 8 rows 10.3 / 14.5 until the L = 64
    # ring deepened (+2 instructions each, same L = 128 source), 10.4 / 14.6 until the ring's stream took arrays of
    # pieces for the two-tile items (ptxas, the loop's source is the same: +5 / +9 instructions of address
    # rematerialization at the 128-register cap); 2 hybrid 10.5 until the ring loop moved to kvkernels/code_ring.cuh
    # (same source: ptxas allocates these 128-register rows differently with unrelated changes) and 10.7 -> 11.0 when
    # the warp's first ring items started before the query staging (2026-11-29, the loop's source unchanged). 2 hybrid
    # at 8 rows went 10.2 -> 9.2, within the budget, when the ring's scales were converted by half (ScalePairs: one
    # HADD2.F32 with a half selector and |.|, no mask of hybrid's sign bit; 2026-11-29, a later session).
    ("inner_q", 1, "asym", 8, 0, "steady state"): 10.9,
    ("inner_q", 1, "asym", 8, 0, "key tile (L=128)"): 12.3,
    # keys at head_dim 64 (SmolLM2-135M's, Llama-3.2-1B's shape), the kLoadRing64 kernel: an item is two 16-row tiles of
    # half a chunk (one tile until 2026-11-27: 3 sym 11.1 / 12.9, 2 sym 11.4 / 14.1, 2 hybrid 11.8 / 15.7, 1 asym
    # 16.1 / 21.1 at 4 / 8 rows), so the ring's copies and the loop are paid once per 32 rows; each tile's epilogue
    # (fold, unscale, stores) stays, over 64 values instead of 128. 3 and 2 sym at 4 rows are now within the budget.
    # Since 2026-11-29 (a later session) the zero term of a tile is one zero MMA, as a chunk's at L = 128, not a zero's
    # conversion, the hybrid select and 2 FFMAs per query slot for each (row, block) in each thread of a quad: 2 hybrid
    # 10.5 / 12.2 -> 8.5 (within the budget) / 10.8 at 4 / 8 rows, 1 asym 12.7 / 15.9 -> 12.1 / 14.7. Then the modes
    # with zeros store a pass without query rows past the last without checking for them (ptxas had made the check
    # branches around the epilogue; the L = 128 key tiles too): 2 hybrid at 8 rows 10.8 -> 10.0, within the budget, 1
    # asym 12.1 / 14.7 -> 11.0 / 13.4 at 4 / 8 rows, and at L = 128 11.1 / 12.8 -> 10.8 / 12.2.
    ("inner_q", 1, "asym", 4, 0, "key tile (L=64)"): 11.1,
    ("inner_q", 1, "asym", 8, 0, "key tile (L=64)"): 13.5,
    ("inner_q", 3, "sym", 8, 0, "key tile (L=64)"): 10.7,
    # KIVI 1 bit through its ring (the preset rows since the ring): 10.6 / 11.7 with register loads, which model
    # latency-bound at 40 % (8 KB in flight per SM); the ring's shared-memory reads add ~8 / ~12 instructions a step
    ("kivi", 1, "asym", 4, 16, "steady state"): 11.2,  # 11.1 until the ring prefill before the staging (2026-11-29)
    ("kivi", 1, "asym", 8, 16, "steady state"): 12.5,
    # 64-column value stores (head_dim 64) through the ring's two-k-step items since 2026-11-28: 13.5 / 14.6 with
    # register loads, latency-bound at 20 % (4 KB in flight per SM), now 11.8 / 13.9 at 94 / 80 %; 2 bits at 8 rows
    # went 10.0 (30 %) -> 9.8 (100 %)
    ("kivi", 1, "asym", 4, 8, "steady state"): 11.9,
    ("kivi", 1, "asym", 8, 8, "steady state"): 14.0,
    # decode_attention_fused's store tiles (family, key bits, mode, value bits, mode, query rows, head_dim, loop): one
    # warp step of 64 tokens decodes keys and values (3 bits: 2 instructions per value) and adds the online softmax,
    # the p staging and the rescale of the accumulators, which the GEMVs do not have; at head_dim 64 that fixed work
    # weighs twice as much per byte, 8 query rows double the MMAs and folds, 1 bit pays a scale and a zero per 32
    # values. innerq_base / innerq_small / innerq_hybrid at head_dim 128, 4 rows, and every 4-bit row are within the
    # budget. Since 2026-11-29 the step's group affines come from a per-warp table (each (token or channel, group)
    # loaded and converted once, not by all 4 threads of a quad with a 64-bit address each), which cut 2-20 % of a
    # step and let the 8-row head_dim-128 instantiations with zero points take 64-token steps (1 asym 20.3 -> 15.7,
    # innerq_hybrid 14.3 -> 10.9); +0.1-1.2 before that from the L2 prefetch of each warp's next step (a latency lever
    # the model does not see; the attention stage's `fused no prefetch` rows are the before on a GPU). Later that day
    # the softmax took its scores in q' units (2^-e, log2(e) and 2^14 folded into one FFMA before each ex2, the causal
    # limit one 32-bit subtraction a step), 1-4 % of a step on every tile: innerq_base / innerq_small / innerq_hybrid
    # at head_dim 64, 4 rows, went 10.2 / 10.1 / 10.0 -> 9.9 / 9.8 / 9.8, within the budget, and kivi2 there 10.2 ->
    # 9.9. Then the 8-row tiles' MMAs took the query rows as B's 8 columns and the hi / lo halves as two more k-steps
    # (block_mma4: the same 4 MMAs a block, no FADD of hi and lo after each): 8 rows at head_dim 128 10.6 -> 10.1-10.2,
    # at 64 12.9-13.4 -> 11.8-12.5, the 1-bit preset 15.3 / 19.8 -> 14.7 / 17.5. And the steps below every row's
    # causal limit without a caller's mask (every step of a q_len-1 decode) run a loop of their own without the masking
    # code (the other steps: the `masked steps` rows, not gated, ~ the numbers before): innerq_base / innerq_small /
    # innerq_hybrid at 8 rows and head_dim 128 -> 9.6 / 9.3 / 9.4, within the budget; at 64 10.6 / 11.2 / 11.3; 4
    # rows at head_dim 128 keep one loop (two spilled at 168 registers). A later session that day: p = exp2(s - m)
    # against 0 where a row has seen nothing (every score -inf), not a select per score (a zeroing move before each
    # predicated ex2): -0.1 to -0.3 on these rows. 2026-11-29 (later): at 8 rows each lane splits its p pairs once
    # into both halves (split_pairs; b_fragment had split every pair twice, once per half, the hi half's "lo" work
    # included), the visible-steps softmax is one FFMA a score (ex2(s kl + (14 - m kl))), and at head_dim 64 x 8 rows
    # every row a thread loads from is a laundered pointer of its own (kRowPtrs: ptxas had re-derived the slice bases
    # and each row's address every step, ~110 instructions): innerq_base / innerq_small / innerq_hybrid there 10.5 /
    # 11.1 / 11.2 -> 9.9 / 9.7 / 9.8, within the budget; at head_dim 128 x 8 rows 9.5 / 9.3 / 9.4 -> 9.2 / 9.0 / 9.1;
    # 1 bit 15.1 / 13.6 / 12.5 (8 x 64, 8 x 128, 4 x 64) -> 13.9 / 13.1 / 12.2.
    ("attn_store", 1, "asym", 1, "asym", 4, 128, "steady state"): 11.4,
    ("attn_store", 1, "asym", 1, "asym", 4, 64, "steady state"): 12.3,
    ("attn_store", 1, "asym", 1, "asym", 8, 128, "steady state"): 13.2,
    ("attn_store", 1, "asym", 1, "asym", 8, 64, "steady state"): 14.0,
    # the KIVI tiles (kivi_tiles_kernel): the dequantization is 2 instructions per value pair more than the InnerQ
    # tiles' decode (a PRMT gathers two rows' codes, an HFMA2 applies s u + z before the MMA). Until 2026-11-29 every
    # k-step also loaded its 4 rows' scales and zeros one 2-byte load at a time (~3 instructions of address each, a
    # PRMT per pair, 4 lanes loading the same values); the warp's scale / zero tables cut 15-22 % of each step (kivi2
    # at head_dim 128: 10.1 / 12.6 -> 8.1 / 9.9 at 4 / 8 rows, now within the budget; kivi1 15.1 / 18.8 -> 12.0 / 14.6).
    # kivi4 at head_dim 128 and 64, 4 and 8 rows, is within the budget, and kivi2 at head_dim 64 and 4 rows since the
    # softmax's fold (above). The visible-steps loop (above) took kivi2 at head_dim 64 x 8 rows 12.3 -> 11.1, the 1-bit
    # rows 11.9-18.2 -> 11.5-16.4. Then (2026-11-29, a later session) p was split into its fp16 halves once, by the
    # thread that computes it, instead of by each of the lanes that read it back (16 split pairs -> 4 a row and step),
    # and 8 rows took the InnerQ tiles' k-split MMAs (B's columns the 8 rows, hi / lo two MMAs into one accumulator: no
    # FADD of the halves, half the accumulators to rescale): kivi2 at head_dim 64 x 8 rows 11.1 -> 10.3, at 128 9.0 ->
    # 8.5, the 1-bit rows at 8 rows 13.3 / 16.4 -> 12.6 / 15.2; 1 bit at head_dim 64 x 4 rows went 13.1 -> 13.3 (-24
    # instructions of split, +39 of addresses that ptxas now recomputes in the loop: strides and row offsets). Then
    # each of a thread's 4 code rows (keys, values) and its key scale / zero rows became a pointer of its own, moved on
    # by one 64-bit add per k-step (`launder`: ptxas had re-derived every load's address from one base, a multiply and
    # a 64-bit add), and the softmax's p no longer selects per score (above): kivi2 at head_dim 64 x 8 rows 986 -> 954
    # instructions a step, 10.3 -> 9.9, within the budget; 1 bit 11.3 / 12.5 / 13.3 / 15.1 -> 11.0 / 12.1 / 12.2 /
    # 14.6. The visible-steps softmax's one FFMA a score (above): -4 to -13 instructions a step, 1 bit 14.6 -> 14.5 at
    # head_dim 64 x 8 rows.
    ("attn_kivi", 1, "asym", 1, "asym", 4, 128, "steady state"): 11.0,
    ("attn_kivi", 1, "asym", 1, "asym", 8, 128, "steady state"): 12.1,
    ("attn_kivi", 1, "asym", 1, "asym", 4, 64, "steady state"): 12.2,
    ("attn_kivi", 1, "asym", 1, "asym", 8, 64, "steady state"): 14.5,
    # Lattice (family, grid, query rows, D or channels per warp, G (keys), norms in B (values), loop). At head_dim 64
    # a keys tile / values k-step has half the bytes of head_dim 128 while its fixed work stays (row pointers, loop,
    # norms, the 16-token output stores), and 8 query rows double the MMAs (HMMA 4 per 16x16 tile of codes at 2
    # bits); EDEN2-64's 6-bit indices cost 2.5 ALU per lookup (the 16th index is gathered from three words), and
    # values pay one PRMT per A register to put two tokens in it (a looked-up half2 holds two channels of one token).
    # Keys at head_dim 64 and 8 rows went 10.7-11.0 -> 10.3-10.5 with the code ring's two-tile items (its copies and
    # rotation paid per 32 rows), values 10.1-11.2 -> 10.0-10.7 with value_unroll's k-step batches (the loop's
    # pointer and fragment bookkeeping paid per batch); every other lattice row is now <= 10 (2026-11-27). The 8-row
    # keys took the k-split MMAs on 2026-11-29 (a later session; gemv_lattice.cu's key_kdup: no FADD of the hi / lo
    # halves per group fold): at head_dim 64 10.3-10.6 -> 9.1-9.6, within the budget, and off their KNOWN_OVER rows.
    ("lattice_v", "EDEN2-64", 4, 64, 0, False, "steady state"): 10.1,
    ("lattice_v", "EDEN2-64", 8, 64, 0, False, "steady state"): 10.8,
}


def row_key(r: Row) -> tuple:
    if r.spec.family in ATTN_TILES:
        return (
            r.spec.family,
            r.spec.bits,
            r.spec.mode,
            r.spec.vbits,
            r.spec.vmode,
            r.spec.query_rows,
            r.spec.dim,
            r.what,
        )
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
        return (s.bits, s.mode) in PRESET_INNER_Q and s.ring  # the presets' stores meet ring_ok
    if s.family == "lattice_k":  # every grid, head_dim and group size, as launched: the ring up to head_dim 128
        return s.ring or s.dim > 128
    if s.family == "lattice_v":  # every grid, head_dim and group size (issue: <= 10 for the lattice GEMVs)
        return True
    if s.family in ATTN_TILES:  # instantiated for the InnerQ / KIVI presets' (bits, mode) pairs only
        return True
    # the presets' stores meet kivi_ring_ok: 16 columns per lane, and the 64-column value stores (8: head_dim 64)
    return s.bits in PRESET_KIVI and s.ring


def in_flight(m: dict, k: Kernel, loop: Loop, bytes_per_iter: float, ctas: int, threads: int) -> None:
    """Adds the memory-parallelism ceiling to a row's model m (in place).

    A loop whose loads are used in the same iteration has one iteration's bytes in flight per warp; a cp.async
    pipeline waiting with `DEPBAR.LE SB0, N` has N + 1. Bytes in flight per SM (x resident warps) over the load
    latency bound the rate (Little's law); "pct_copy_bw" becomes the lower of this and the issue model, and the
    bottleneck "latency" where this one binds. It was the missing term when the first GPU run measured the
    register-load GEMVs at 10-70 % of what the issue model predicted.
    """
    deps = [re.search(r"DEPBAR\.LE SB0, (0x[0-9a-f]+|\d+)", text) for _, op, text in body(k, loop)]
    depth = max([int(d.group(1), 0) + 1 for d in deps if d] or [1])
    mach = MACHINES[k.arch]
    warps = ctas * ((threads + 31) // 32)
    fly = depth * bytes_per_iter * warps
    rate = fly / (mach["latency_s"] * mach["clock"])  # bytes per clock per SM
    pct = min(100.0, 100 * rate / mach["copy_bytes_per_clk_sm"])
    m["iterations_in_flight"] = depth
    m["kb_in_flight_per_sm"] = fly / 1024
    m["pct_latency_bound"] = pct
    if pct < m["pct_copy_bw"]:
        m["pct_copy_bw"] = pct
        m["bottleneck"] = "latency"


def analyse(kernels: list[Kernel]) -> list[Row]:
    rows = []
    for k in kernels:
        s = spec_of(k.name)
        if s is None or k.arch not in MACHINES:
            continue
        ctas = ctas_per_sm(k.regs, s.threads, k.arch)
        if s.ring64:  # keys at head_dim 64 only: no steady state, no L = 128 tile
            half = half_tile_loop(k, None, None)
            if half is None:
                raise RuntimeError(f"no L = 64 key-tile loop found in {k.name} (sm_{k.arch})")
            rows.append(l64_row(k, s, half, ctas))
            continue
        hot, key = hot_loops(k)
        if hot is None:
            raise RuntimeError(f"no steady-state loop found in {k.name} (sm_{k.arch})")
        nbytes = bytes_per_iteration(s)
        if s.family.startswith("lattice"):
            try:
                nbytes *= lattice_units(s, op_count(k, hot, "HMMA"))
            except ValueError as e:
                raise RuntimeError(f"{k.name} (sm_{k.arch}): {e}") from None
        rows.append(loop_row(k, s, hot, "steady state", nbytes, ctas))
        if s.family in ATTN_TILES:
            masked = masked_steps_loop(k, hot)
            if masked is not None:  # reported, not gated: see masked_steps_loop
                rows.append(dataclasses.replace(loop_row(k, s, masked, "masked steps", nbytes, ctas), preset=False))
        if key is not None:
            rows.append(loop_row(k, s, key, "key tile (L=128)", key_tile_bytes(s), ctas))
        if s.family == "inner_q" and s.ring and s.bits == 4:  # 4-bit keys at head_dim 64: one-tile ring items
            half = half_tile_loop(k, hot, key)
            if half is None:
                raise RuntimeError(f"no L = 64 key-tile loop found in {k.name} (sm_{k.arch})")
            rows.append(l64_row(k, s, half, ctas))
    return rows


def loop_row(k: Kernel, s: Spec, loop: Loop, what: str, nbytes: float, ctas: int) -> Row:
    mt = model(count(body(k, loop)), nbytes, k.arch)
    mt["loop"] = [hex(loop.start), hex(loop.end)]
    mt["local_memory_in_loop"] = sum(1 for _, op, _ in body(k, loop) if op.split(".")[0] in ("LDL", "STL"))
    in_flight(mt, k, loop, nbytes, ctas, s.threads)
    return Row(k.name, k.arch, s, k.regs, k.spill_bytes, ctas, what, mt, is_preset(s, k.arch))


def l64_row(k: Kernel, s: Spec, loop: Loop, ctas: int) -> Row:
    """The "key tile (L=64)" row: an item of ring64_tiles 16-row tiles, 2 blocks x 2 k-steps x n-tiles MMAs each, and
    with zero points one zero MMA per n-tile in the two-tile kernel, but at 8 query rows on sm_90 only (the one-tile
    items and 8 rows before sm_90 fold the zeros in fp32: gemv_inner_q.cu, l64_zero_mma)."""
    tiles_per_item = ring64_tiles(s.bits)
    per_tile = 4 * s.ntiles + s.ntiles * (s.mode != "sym" and s.ring64 and (s.ntiles == 1 or int(k.arch) >= 90))
    if op_count(k, loop, "HMMA") != per_tile * tiles_per_item:
        raise RuntimeError(
            f"{k.name} (sm_{k.arch}): the L = 64 key loop holds {op_count(k, loop, 'HMMA')} HMMA, not "
            f"{tiles_per_item} tiles' worth ({per_tile} each)"
        )
    return loop_row(k, s, loop, "key tile (L=64)", key_tile_bytes(s) / 2 * tiles_per_item, ctas)


def table(rows: list[Row]) -> str:
    head = (
        "| kernel | bits | mode / grid | query rows | sm | loop | regs | CTAs/SM | instr/iter | bytes/iter | "
        "instr/byte | weighted | KB in flight/SM | bound by | modelled % of copy BW | preset |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
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
            not r.spec.ring,
            r.spec.cpl,
            r.spec.dim,
            r.spec.group,
            r.spec.norms_in_b,
            r.what,
        ),
    ):
        s = r.spec
        if s.family in ATTN_TILES:
            fam = f"decode_attention {'KIVI' if s.family == 'attn_kivi' else 'store'} tiles (D {s.dim})"
        elif s.family == "lattice_k":
            fam = f"gemv_lattice_k (D {s.dim}, G {s.group})"
        elif s.family == "lattice_v":
            fam = f"gemv_lattice_v (channels/warp {s.dim}{', G = D' if s.norms_in_b else ''})"
        else:
            fam = "gemv_inner_q" if s.family == "inner_q" else f"gemv_kivi (cols/lane {s.cpl})"
        narrow = not s.vec and (s.family == "inner_q" or s.family == "kivi" and kivi_has_vec(s))
        fam += ", 32-bit loads" if narrow else ""
        fam += ", cp.async ring" if s.ring else ", 16-byte loads" if s.family == "inner_q" and s.vec else ""
        bits, mode = (f"{s.bits} / {s.vbits}", f"{s.mode} / {s.vmode}") if s.family in ATTN_TILES else (s.bits, s.mode)
        lines.append(
            f"| {fam} | {bits} | {mode} | {s.query_rows} | {r.arch} | {r.what} | {r.regs}"
            f"{' SPILL' if r.spill else ''} | {r.ctas} | {r.m['counts']['issue']} | "
            f"{r.m['bytes_per_warp_iter'] / 32:.1f} | "
            f"{r.m['instr_per_byte']:.1f} | {r.m['weighted_per_byte']:.1f} | "
            f"{r.m['kb_in_flight_per_sm']:.1f} ({r.m['iterations_in_flight']}) | {r.m['bottleneck']} | "
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


# ---- decode_attention_fused: a split-KV attention kernel with runtime switches --------------------------------------
# csrc/cuda/decode_attention.cu's steady state is its 32-token tile loop (stage keys and values into shared memory,
# scores, online softmax, P.V; 3 barriers), not an innermost loop: its staging (load_unit / finish_unit, unrolled over
# a thread's units) holds every runtime case (bits 1-4 behind a switch that ptxas may compile to a jump table, "rows"
# and "cols" units, window and invalid tokens, the 64-bit division helper), so hot_loops (which would pick the loop
# with most LDG) counts code no tile runs. Instead the tile loop is walked as a control-flow graph (nvdisasm -gi:
# every instruction's inline chain of source lines). An instruction belongs to a side's staging when its chain holds
# one of the kernel's load_unit / finish_unit call sites for that side; per side, instructions of another case than
# the tile class's (another bit width, the other unit kind's group, window / invalid tokens, the x_scale multiply when
# there is none, the hybrid scale branch; outside staging the additive mask) are excluded, and a block mostly of
# excluded work is cut, with the 64-bit division call (32-bit operands take the inline path) and what only cut blocks
# reach. What lies on a path from the loop's head to its back edge is counted per execution: a side's staging code
# D / 32 times per CTA (warp-units: D = 128, every thread one key and one value unit; D = 64, warps 0-1 keys, 2-3
# values), the score loop (unroll 4 of the D / 4 float4 steps) the trip count its FFMAs imply (ROWS / 4 rows x D per
# warp), the rest once per warp (4). A branch with both sides on the path is counted on both (an upper bound;
# addresses in --json: the staging's unit-kind tests, where unit_site's cols and rows store branches both stay on the
# path (ptxas merges their address arithmetic), the skip of a zero-fill or of the x_scale multiply, the softmax's row
# guards). At D = 64 ptxas may merge the two sides' staging into one copy carrying either side's lines: the total
# holds (both sides weigh D / 32), the split between "keys unit" and "values unit" does not. Compulsory bytes of a
# tile: keys + values codes of 32 tokens x D and their fp16 scales (+ zeros) at G = 32. Query rows 4 (GQA 4 at q_len
# 1), no mask (causal): the kernel instantiated for row blocks of 4 (ROWS = 4: one row per warp in scores and softmax,
# 4 / (128 / D) per thread in P.V), which the launcher picks for R <= 4.
ATTN_SOURCE = "decode_attention.cu"
CONTROL_ONLY = {"BRA", "BSSY", "BSYNC", "WARPSYNC", "NOP", "CALL", "RET", "EXIT", "BMOV"}


@dataclass(frozen=True)
class AttnSide:
    bits: int
    mode: str  # sym / asym / hybrid
    cols: bool  # store layout "cols" (groups along tokens) or "rows" (groups along channels)
    xs: bool = False  # key_x_scale (InnerQ's key norm)

    def tile_bytes(self, D: int, group_size: int = 32) -> float:
        params = 2 if self.mode == "sym" else 4
        return 32 * D * self.bits / 8 + params * 32 * D / group_size


ATTN_PRESETS = {  # preset: (keys, values) of the tile class (kvkernels/formats: innerq_base, kivi2)
    "innerq_base": (AttnSide(3, "sym", False, xs=True), AttnSide(3, "sym", True)),
    "kivi2": (AttnSide(2, "asym", True), AttnSide(2, "asym", False)),
}
ATTN_DIMS = (128, 64)
ATTN_ROWS = 4  # the row-block instantiation the preset rows are read from (GQA 4 x q_len 1)


def find_nvdisasm(cuobjdump: str | None) -> str | None:
    cands = [shutil.which("nvdisasm")]
    if cuobjdump:
        cands.append(str(Path(cuobjdump).resolve().parent / "nvdisasm"))
    for c in cands:
        if c and Path(c).exists():
            return c
    return None


LINE_INFO = re.compile(r'\s*//## File "([^"]+)", line (\d+)')
LABEL = re.compile(r"^([.$\w]+):\s*$")


def parse_lined_sass(text: str, arch: str) -> list[Kernel]:
    """nvdisasm -gi output of one cubin: kernels with each instruction's inline chain, labels and predicates."""
    kernels, cur, chain, building, pending = [], None, (), None, []
    for line in text.splitlines():
        m = re.match(r"\s*\.text\.(\S+):\s*$", line)
        if m:
            cur = Kernel(arch=arch, mangled=m.group(1))
            kernels.append(cur)
            chain, building, pending = (), None, []
            continue
        if cur is None:
            continue
        m = LINE_INFO.match(line)
        if m:
            building = (building or []) + [(Path(m.group(1)).name, int(m.group(2)))]
            continue
        m = LABEL.match(line.strip())  # .L_x_12: or $__internal_0_$__cuda_sm20_div_s64:
        if m:
            pending.append(m.group(1))
            continue
        m = INSTR.search(line)
        if m:
            if building is not None:
                chain, building = tuple(building), None
            addr, raw = int(m.group(1), 16), m.group(2).strip()
            text_, op = instr_text(raw)
            for lab in pending:
                cur.labels[lab] = addr
            pending = []
            if text_ != raw and not raw.startswith("@PT "):
                cur.predicated.add(addr)
            cur.instrs.append((addr, op, text_))
            cur.chains[addr] = chain
    return kernels


def disassemble_lined(cuobjdump: str, nvdisasm: str, obj: Path) -> list[Kernel]:
    work = obj.with_suffix(".cubins")
    work.mkdir(exist_ok=True)
    subprocess.run([cuobjdump, "-xelf", "all", str(obj.resolve())], cwd=work, capture_output=True, check=True)
    kernels = []
    for cubin in sorted(work.glob("*.cubin")):
        m = re.search(r"sm_(\d+)", cubin.name)
        text = subprocess.run([nvdisasm, "-gi", "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
        kernels += parse_lined_sass(text, m.group(1) if m else "")
    return kernels


@dataclass
class Block:
    start: int
    instrs: list[tuple[int, str, str]]
    succs: list[int] = field(default_factory=list)


def basic_blocks(k: Kernel) -> dict[int, Block]:
    """Basic blocks by start address; successors from BRA (label targets) and fall-through. An indexed jump (BRX, a
    switch's jump table) ends its block with unknown targets: its successors are the labelled blocks no other block
    reaches, from it up to the next BRX (where ptxas places the cases), and its fall-through."""
    ins = [i for i in k.instrs if i[1] not in SKIP]
    target, jumps = {}, set()
    brx = {a for a, op, _ in ins if op.startswith("BRX")}
    for a, op, text in ins:
        m = re.search(r"\(([.$\w]+)\)", text)
        # BRA, and CALL.REL.NOINC to a local label: ptxas's loop exit (`@P0 CALL.REL.NOINC .L_x_50` + `BRA head`,
        # the label being the next instruction) is a jump; a CALL to $__internal_... is a real call (it returns)
        if op.startswith("BRA") or (op.startswith("CALL") and m and m.group(1).startswith(".L")):
            target[a] = k.labels.get(m.group(1)) if m else None
            jumps.add(a)
    leaders = {ins[0][0], *k.labels.values()}
    for idx, (a, op, _) in enumerate(ins[:-1]):
        if a in jumps or a in brx or op.startswith(("EXIT", "RET")):
            leaders.add(ins[idx + 1][0])
    blocks, cur = {}, None
    for a, op, text in ins:
        if a in leaders or cur is None:
            cur = blocks.setdefault(a, Block(a, []))
        cur.instrs.append((a, op, text))
    starts = sorted(blocks)
    for n, s in enumerate(starts):
        b = blocks[s]
        a, op, _ = b.instrs[-1]
        nxt = starts[n + 1] if n + 1 < len(starts) else None
        conditional = a in k.predicated
        if a in jumps:
            if target.get(a) is not None:
                b.succs.append(target[a])
            if conditional and nxt is not None:
                b.succs.append(nxt)
        elif op.startswith(("EXIT", "RET")):
            if conditional and nxt is not None:
                b.succs.append(nxt)
        elif nxt is not None:
            b.succs.append(nxt)
    if brx:
        reached = {t for b in blocks.values() for t in b.succs}
        # subroutines ($__internal_... helpers, reached by CALL only) are never a case, and end the range
        subs = sorted(a for lab, a in k.labels.items() if lab.startswith("$"))
        ends = sorted(brx)
        for n, x in enumerate(ends):
            src = max(st for st in starts if st <= x)
            hi = min([ends[n + 1] if n + 1 < len(ends) else float("inf"), *(a for a in subs if a > x)])
            blocks[src].succs += [st for st in starts if x < st < hi and st not in reached and st != starts[0]]
    return blocks


def _reach(blocks: dict[int, Block], start: int, allowed: set[int], cut: set[tuple[int, int]], rev=False) -> set[int]:
    """Blocks reachable from start (rev: that reach start) inside `allowed`, never over an edge in `cut`."""
    preds: dict[int, list[int]] = {}
    if rev:
        for s, b in blocks.items():
            for t in b.succs:
                preds.setdefault(t, []).append(s)
    seen, todo = set(), [start]
    while todo:
        x = todo.pop()
        if x in seen or x not in allowed:
            continue
        seen.add(x)
        nxt = preds.get(x, []) if rev else blocks[x].succs
        for y in nxt:
            if ((x, y) if not rev else (y, x)) in cut:
                continue
            todo.append(y)
    return seen


def source_lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def _line_of(lines: list[str], pattern: str, after: int = 0) -> int:
    for n in range(after, len(lines)):
        if re.search(pattern, lines[n]):
            return n + 1  # 1-based, as the line table
    raise RuntimeError(f"decode_attention source: no line matches {pattern!r} (after line {after})")


def _block_lines(lines: list[str], head: int) -> set[int]:
    """1-based lines inside the brace block whose `{` ends line `head`, up to the line that closes it."""
    depth, out = 1, set()
    for n in range(head, len(lines)):
        if lines[n].strip().startswith("}") and depth == 1:
            return out
        out.add(n + 1)
        depth += lines[n].count("{") - lines[n].count("}")
        if depth <= 0:
            return out
    raise RuntimeError(f"decode_attention source: no closing brace for the block on line {head}")


def attention_markers(src: Path, quant: Path) -> dict:
    """Source lines that tell the tile classes apart (found by pattern, so edits to the kernel move them along)."""
    L = source_lines(src)
    q = source_lines(quant)
    fname, qname = src.name, quant.name
    site = _line_of(L, r"UnitSite unit_site\(")
    channel_site = _line_of(L, r"if \(sd\.cols && j0 >= S && j0 < S \+ sd\.m\) \{", site)
    window_site = _line_of(L, r"if \(j < S \|\| j >= S \+ sd\.m\) \{", channel_site)
    rows_site = _line_of(L, r"const int64_t r = j - S;", window_site)
    load = _line_of(L, r"UnitLoad load_unit\(")
    load_w16 = _line_of(L, r"\} else if \(site\.kind == UnitKind::kWindow16\) \{", load)
    finish = _line_of(L, r"void finish_unit\(")
    fin_w16 = _line_of(L, r"\} else if \(site\.kind == UnitKind::kWindow16\) \{", finish)
    fin_w = _line_of(L, r"\} else if \(site\.kind == UnitKind::kWindow\) \{", fin_w16)
    fin_zero = _line_of(L, r"^\s*\} else \{\s*$", fin_w)
    fin_channel = _line_of(L, r"if \(site\.channel\) \{", fin_zero)
    fin_rows = _line_of(L, r"const int c0 = 32 \* \(w / kTile\);", fin_channel)
    fin_end = _line_of(L, r"^\}\s*$", fin_rows)
    xs_mul = _line_of(L, r"v\[i\] \*= x4\.x", fin_rows)
    rt = _line_of(L, r"void dequant_words_rt\(")
    cases = {b: (fname, _line_of(L, rf"case {b}: dequant_words<{b}>", rt)) for b in (1, 2, 3)}
    cases[4] = (fname, _line_of(L, r"default: dequant_words<4>", rt))
    grt = _line_of(q, r"GroupAffine group_affine_rt\(")
    hyb = _line_of(q, r"if \(mode == QuantMode::kHybrid\) \{", grt)
    hyb_end = _line_of(q, r"^\s*\}\s*$", hyb)
    # a store unit takes the first branch of load_unit's and finish_unit's kind dispatch: the other branches' heads
    # are off its path too (the window-site test in unit_site is not: a rows store token passes it)
    not_store = _block_lines(L, window_site)
    for head in (load_w16, fin_w16, fin_w, fin_zero):
        not_store |= {head} | _block_lines(L, head)
    return {
        # the kernel's call sites of a side's staging (every instruction of it carries one in its inline chain)
        "keys": {(fname, _line_of(L, p)) for p in (r"= load_unit<D>\(sk,", r"finish_unit<D>\(ld\[i\], sk,")},
        "values": {(fname, _line_of(L, p)) for p in (r"= load_unit<D>\(sv,", r"finish_unit<D>\(ld\[i\], sv,")},
        # code of one unit kind only: a cols unit's block and group, and its column writes; a rows unit's token and
        # group, and its row writes (not the address arithmetic of unit_site's two store returns: ptxas merges it
        # into one copy, with either return's lines)
        "channel_only": {(fname, n) for n in (channel_site + 1, channel_site + 2, *_block_lines(L, fin_channel))},
        "rows_only": {(fname, n) for n in (rows_site, rows_site + 1, *range(fin_rows, fin_end))},
        # window and invalid-token code (the tile classes are store tiles)
        "not_store": {(fname, n) for n in not_store},
        "xs_multiply": {(fname, xs_mul), (fname, xs_mul - 1)},
        "cases": cases,
        "hybrid": {(qname, n) for n in range(hyb + 1, hyb_end)},
        "mask": (fname, _line_of(L, r"sc = s\[k\] \+ __ldg\(mrow")),
        "score_fma": {(fname, _line_of(L, r"s\[k\] = fmaf\(xv\.x, kv\.x, s\[k\]\)") + i) for i in range(4)},
    }


@dataclass
class AttnRow:
    preset: str
    D: int
    arch: str
    regs: int
    spill: int
    ctas: int
    counts: dict  # pipe counts of one tile, whole CTA (4 warps)
    parts: dict  # issue count per part (keys unit, values unit, staging loop, scores loop, rest) per CTA tile
    bytes_per_tile: float
    m: dict
    both_sides: list  # branches counted on both sides (addresses)
    local_memory_in_loop: int


def attention_tile(k: Kernel, D: int, keys: AttnSide, values: AttnSide, mk: dict, smem_ctas: int) -> AttnRow:
    blocks = basic_blocks(k)
    loops = find_loops(k)
    chain = k.chains

    def side_of(ch) -> str | None:  # the staging side an instruction's inline chain belongs to
        if mk["keys"] & set(ch):
            return "keys"
        if mk["values"] & set(ch):
            return "values"
        return None

    def score_fma(ch) -> bool:
        return any(x in mk["score_fma"] for x in ch)

    def in_loop(lp, pred):
        return any(pred(chain.get(a, ())) for a, _, _ in body(k, lp))

    # loops: tile (the smallest loop holding both the staging and the score FFMAs), scores (inside it, holds the score
    # FFMAs, not the staging)
    tiles = [lp for lp in loops if in_loop(lp, lambda ch: side_of(ch) is not None) and in_loop(lp, score_fma)]
    if not tiles:
        raise RuntimeError(f"decode_attention D {D} sm_{k.arch}: no loop holds both the staging and the scores")
    tile = min(tiles, key=lambda lp: lp.end - lp.start)
    scores = [
        lp
        for lp in loops
        if tile.contains(lp) and lp != tile and in_loop(lp, score_fma) and not in_loop(lp, lambda c: side_of(c))
    ]
    if len(scores) != 1:
        raise RuntimeError(f"decode_attention D {D} sm_{k.arch}: expected one score loop, found {len(scores)}")
    scores = scores[0]
    sides = {"keys": keys, "values": values}

    # At D = 64 a thread's one unit is a key or a value unit by its warp, a runtime choice: ptxas merges code of the
    # two sides' staging into one copy carrying either call site's lines (for kivi2 the shared start of finish_unit
    # carried the keys' only, and the keys' rules cut the values' decode: 49.0 where it is ~54). There each side's
    # path is walked on its own, every staging instruction judged by that side's rules, and the blocks of the other
    # side's call site dropped wherever the path holds without them (its own copy; a merged block stays).
    runtime_sides = 2 * D // 128 == 1  # one staging unit a thread (the kernel's kUnits at 128 threads)

    def excluded_for(sd: AttnSide, here: set) -> bool:
        if here & mk["not_store"] or here & mk["rows_only" if sd.cols else "channel_only"]:
            return True
        if not sd.xs and here & mk["xs_multiply"]:
            return True
        if any(mk["cases"][b] in here for b in mk["cases"] if b != sd.bits):
            return True
        return sd.mode != "hybrid" and bool(here & mk["hybrid"])

    def excluded(ch, walking: str | None) -> bool:
        """Off the tile class's path; staging code judged by the walked side's rules, or (walking None) its own."""
        if not ch:
            return False
        if mk["mask"] in ch:  # no additive mask (decode at q_len 1: the causal rule)
            return True
        name = side_of(ch)
        if name is None:
            return False
        return excluded_for(sides[walking or name], set(ch))

    def work_of(b: Block) -> list:
        return [x for x in b.instrs if x[1].split(".")[0] not in CONTROL_ONLY]  # a join's BSYNC: any line

    preds: dict[int, list[int]] = {}
    for s, b in blocks.items():
        for t in b.succs:
            preds.setdefault(t, []).append(s)

    # Blocks cut from the path: most of a cut block's work comes from another case (a block on the path may hold a
    # few instructions hoisted from a case it skips, e.g. address arithmetic); the 64-bit division helper (32-bit
    # operands take the inline path); what only cut blocks reach.
    def allowed_blocks(walking: str | None = None) -> set[int]:
        cut = set()
        for s, b in blocks.items():
            if any(op.startswith("CALL") and "$__internal" in t for _, op, t in b.instrs):
                cut.add(s)
                continue
            work = work_of(b)
            n = sum(1 for a, _, _ in work if excluded(chain.get(a, ()), walking))
            if 2 * n > len(work) and n >= 4:  # small blocks (joins, dispatch compares) carry any neighbour's line
                cut.add(s)
        changed = True
        while changed:
            changed = False
            for s in blocks:
                if s not in cut and preds.get(s) and all(x in cut for x in preds[s]):
                    cut.add(s)
                    changed = True
        return set(blocks) - cut

    def latch_of(lp: Loop) -> int:
        return max(s for s in blocks if s <= lp.end)

    back = (latch_of(tile), tile.start)

    def path_in(allowed: set[int]) -> set[int]:
        return _reach(blocks, tile.start, allowed, {back}) & _reach(blocks, back[0], allowed, {back}, rev=True)

    side_path: dict[str, set[int]] = {}
    if runtime_sides:
        for name in sides:
            allowed = allowed_blocks(name)
            other = [
                s
                for s in sorted(blocks)
                if s in allowed
                and (owners := [side_of(chain.get(a, ())) for a, _, _ in work_of(blocks[s])])
                and sum(o not in (None, name) for o in owners) * 2 > len(owners)
            ]
            for s in other:  # drop the other side's blocks the path does not need
                if back[0] in path_in(allowed - {s}):
                    allowed.discard(s)
            side_path[name] = path_in(allowed)
        on_path = side_path["keys"] | side_path["values"]
    else:
        on_path = path_in(allowed_blocks())
    if tile.start not in on_path:
        raise RuntimeError(f"decode_attention D {D} sm_{k.arch}: no path through the tile loop")
    score_b = _reach(blocks, scores.start, on_path, {back}) & _reach(
        blocks, latch_of(scores), on_path, {back}, rev=True
    )
    for name in sides:
        if not any(side_of(chain.get(a, ())) == name for s in on_path for a, _, _ in blocks[s].instrs):
            raise RuntimeError(f"decode_attention D {D} sm_{k.arch}: no staging path for {name} {sides[name]}")

    # score loop trip count from its FFMAs: ATTN_ROWS / 4 rows x D per warp
    def fma_score(bs):
        return sum(
            1 for s in bs for a, op, _ in blocks[s].instrs if op.startswith("FFMA") and score_fma(chain.get(a, ()))
        )

    inside, outside = fma_score(score_b), fma_score(on_path - score_b)
    trip = (ATTN_ROWS // 4 * D - outside) / inside if inside else 0
    if trip != int(trip) or trip < 1:
        raise RuntimeError(f"decode_attention D {D} sm_{k.arch}: score FFMAs {inside} / loop, {outside} outside")
    # executions per CTA tile: a side's staging code D / 32 times (warp-units of 32 units: D = 128, every thread one
    # key and one value unit; D = 64, warps 0-1 keys, 2-3 values), the score loop 4 x its trip count, the rest once
    # per warp (4)
    units = D // 32
    tot = {p: 0 for p in ("issue", "alu", "fma", "imad", "mio", "lsu", "hmma", "xu")}
    parts = {"keys unit": 0, "values unit": 0, "scores loop": 0, "rest": 0}
    local = 0
    counted = []  # (instruction, weight, part)
    for s in on_path:
        for ins in blocks[s].instrs:
            name = side_of(chain.get(ins[0], ()))
            if s in score_b:
                counted.append((ins, 4 * int(trip), "scores loop"))
            elif name is None:
                counted.append((ins, 4, "rest"))
            elif not runtime_sides:
                counted.append((ins, units, f"{name} unit"))
    if runtime_sides:  # each side's staging on its own path, by the warps that run that side
        for name, path in side_path.items():
            counted += [
                (ins, units, f"{name} unit")
                for s in path
                if s not in score_b
                for ins in blocks[s].instrs
                if side_of(chain.get(ins[0], ())) is not None
            ]
    for ins, w, part in counted:
        c = count([ins])
        for p in tot:
            tot[p] += w * c[p]
        parts[part] += w * c["issue"]
        local += ins[1].split(".")[0] in ("LDL", "STL")
    both = []  # branches with both successors on the path: counted on both sides (an upper bound)
    loop_edges = {back, (latch_of(scores), scores.start)}
    for s in on_path:
        b = blocks[s]
        a = b.instrs[-1][0]
        if a in k.predicated and sum(1 for t in b.succs if t in on_path and (s, t) not in loop_edges) == 2:
            both.append(a)
    nbytes = keys.tile_bytes(D) + values.tile_bytes(D)
    ctas = min(ctas_per_sm(k.regs, 128, k.arch), smem_ctas)
    m = model(tot, nbytes, k.arch)
    m["loop"] = [hex(tile.start), hex(tile.end)]
    m["score_trip"] = int(trip)
    return AttnRow("", D, k.arch, k.regs, k.spill_bytes, ctas, tot, parts, nbytes, m, sorted(set(both)), local)


def attention_smem_bytes(D: int, rows: int = ATTN_ROWS) -> int:
    """Dynamic shared memory of a CTA (mirrors smem_floats in csrc/cuda/decode_attention.cu)."""
    return 4 * (2 * 32 * (D + 4) + rows * D + rows * 32 + 3 * rows + D)


def attention_rows(kernels: list[Kernel]) -> list[AttnRow]:
    mk = attention_markers(ROOT / "csrc" / "cuda" / ATTN_SOURCE, ROOT / "csrc" / "kvkernels" / "quant.cuh")
    rows = []
    for k in kernels:
        # the exact-size instantiation for ATTN_ROWS rows (the lengths form, <D, ROWS, true>, differs only in where
        # the counts come from)
        m = re.search(rf"decode_attention_kernel<(\d+), {ATTN_ROWS}, false>", k.name)
        if m is None or k.arch not in MACHINES:
            continue
        D = int(m.group(1))
        smem = MACHINES[k.arch]["smem_per_sm"] // (attention_smem_bytes(D) + 1024)
        for preset, (keys, values) in ATTN_PRESETS.items():
            r = attention_tile(k, D, keys, values, mk, smem)
            r.preset = preset
            rows.append(r)
    return rows


# Ceilings CI holds the general fused attention tiles to (sm_90, weighted instr/byte; the recorded value + ~3 %): the
# general kernel is far over the GEMVs' budget (bench/README.md); on InnerQ caches it now runs only the sink, tails and
# store edges (the store tiles are decode_attention_store.cu's, gated in the main table). A regression fails, an
# improvement should lower the ceiling.
ATTN_CEILING: dict[tuple[str, int], float] = {
    # (preset, head_dim): ceiling (recorded with nvcc 13.0, 4-row instantiation). 42.0 / 47.7 / 45.5 / 52.2 until the
    # staging issued all of a thread's reads before decoding any (load_unit / finish_unit, 2026-11-29): one memory
    # round trip a tile instead of about four, for 47.1 / 48.4 / 51.4 / 51.8 by this walk (part of the rise is the
    # walk's: both of unit_site's store branches are counted, ~40 instructions a warp-unit; D = 64 walked per side).
    # D = 64 48.4 / 51.8 -> 50.1 / 53.7 when the kernel began to prefetch its first tile's units into L2 before the
    # query staging (2026-11-29, prefetch_unit; outside the tile loop: ptxas allocated the loop with 158 registers
    # instead of 167, +72 instructions in a key unit); D = 128 moved by +0.1
    ("innerq_base", 128): 48.6,
    ("innerq_base", 64): 51.6,
    ("kivi2", 128): 53.0,
    ("kivi2", 64): 55.3,
}


def attention_table(rows: list[AttnRow]) -> str:
    out = [
        "| preset (keys / values) | head_dim | sm | regs | CTAs/SM | instr per tile (CTA) | keys units / values units"
        " / scores loop / rest | FP32 pipe | LDS+STS+SHFL | LDG | bytes/tile | instr/byte | weighted | bound by | "
        "modelled % of copy BW |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r.preset, -int(r.arch), -r.D)):
        keys, values = ATTN_PRESETS[r.preset]

        def side(s: AttnSide) -> str:
            return f"{s.bits}-bit {s.mode} {'cols' if s.cols else 'rows'}{' x_scale' if s.xs else ''}"

        p = r.parts
        out.append(
            f"| {r.preset} ({side(keys)} / {side(values)}) | {r.D} | {r.arch} | {r.regs}{' SPILL' if r.spill else ''} |"
            f" {r.ctas} | {r.counts['issue']} | {p['keys unit']} / {p['values unit']} / {p['scores loop']} /"
            f" {p['rest']} |"
            f" {r.counts['fma'] - r.counts['imad']} | {r.counts['mio']} | "
            f"{r.counts['lsu']} | {r.bytes_per_tile:.0f} | {r.m['instr_per_byte']:.1f} | "
            f"{r.m['weighted_per_byte']:.1f} | {r.m['bottleneck']} | {r.m['pct_copy_bw']:.0f}% |"
        )
    return "\n".join(out) + "\n"


def build(
    archs: list[str], sources: list[Path], out_dir: Path, jobs: int = 2, lined: tuple[str, ...] = ()
) -> list[Kernel]:
    """Compiled kernels of the sources; those named in `lined` disassembled by nvdisasm -gi (line info, labels)."""
    nvcc = find_nvcc()
    cuobjdump = find_cuobjdump(nvcc)
    nvdisasm = find_nvdisasm(cuobjdump) if lined else None
    if nvcc is None or cuobjdump is None or (lined and nvdisasm is None):
        raise FileNotFoundError(
            f"sass_budget needs nvcc, cuobjdump and nvdisasm (found nvcc={nvcc}, cuobjdump={cuobjdump},"
            f" nvdisasm={nvdisasm})"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(jobs) as ex:
        built = list(ex.map(lambda s: prebuilt_object(s, archs) or compile_object(nvcc, s, archs, out_dir), sources))
    reused = [s.name for s, (obj, _) in zip(sources, built, strict=True) if obj.parent == PREBUILT_DIR]
    if reused:
        print(f"sass_budget: reusing .ci/nvcc_check.sh's objects ({PREBUILT_DIR}) for {', '.join(reused)}")
    kernels = []
    for src, (obj, log) in zip(sources, built, strict=True):
        regs = parse_ptxas(log)
        if src.name in lined:
            ks = disassemble_lined(cuobjdump, nvdisasm, obj)
        else:
            sass = subprocess.run([cuobjdump, "-sass", str(obj)], capture_output=True, text=True, check=True).stdout
            ks = parse_sass(sass)
        ks = [k for k in ks if k.arch in archs]  # a prebuilt object holds every arch nvcc_check builds
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
        kernels = build(
            a.archs,
            [ROOT / "csrc" / "cuda" / s for s in (*SOURCES, AQUA_SOURCE, ATTN_SOURCE)],
            a.build_dir,
            lined=(ATTN_SOURCE,),
        )
    except FileNotFoundError as e:
        print(f"sass_budget: SKIP ({e})")
        return 0
    rows = analyse(kernels)
    aqua = aqua_rows(kernels)
    out = table([r for r in rows if r.preset] if a.presets_only else rows)
    out += "\naqua_reconstruct (a GEMM: instructions per HMMA, not per byte; static model, unverified on a GPU):\n\n"
    out += aqua_table(aqua)
    attn = attention_rows(kernels)
    out += (
        "\ndecode_attention_fused (one 32-token tile of a CTA: the 4-row instantiation, GQA 4 x q_len 1; "
        "static model, unverified on a GPU):\n\n"
    )
    out += attention_table(attn)
    print(out)
    if a.markdown:
        a.markdown.write_text(out)
    if a.json:
        a.json.write_text(
            json.dumps(
                [{**r.__dict__, "spec": r.spec.__dict__} for r in rows]
                + [r.__dict__ for r in aqua]
                + [{**r.__dict__, "both_sides": [hex(x) for x in r.both_sides]} for r in attn],
                indent=1,
            )
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
    # decode_attention_fused: every (preset, head_dim) on sm_90 present and under its ceiling, no local memory
    attn90 = {(r.preset, r.D): r for r in attn if r.arch == "90"}
    attn_bad = [key for key in ATTN_CEILING if "90" in a.archs and key not in attn90]
    for key in attn_bad:
        print(f"  MISSING: decode_attention_fused {key[0]} head_dim {key[1]} sm_90 (no tile loop found)")
    for key, r in sorted(attn90.items()):
        ceil = ATTN_CEILING.get(key)
        worse = ceil is None or r.m["weighted_per_byte"] > ceil
        print(
            f"decode_attention_fused {key[0]} head_dim {key[1]} sm_90: {r.m['weighted_per_byte']:.1f} weighted "
            f"instr/byte (ceiling {ceil}; budget {a.budget}){' OVER' if worse else ''}"
        )
        if worse:
            attn_bad.append(key)
    for r in attn:
        if r.local_memory_in_loop:
            print(f"  LOCAL MEMORY IN HOT LOOP: decode_attention_fused {r.preset} D {r.D} sm_{r.arch}")
            if r.arch == "90":
                attn_bad.append((r.preset, r.D))
    fail = bool(over) or any(r.arch == "90" for r in local + aqua_local) or bool(attn_bad)
    return 0 if a.no_gate or not fail else 1


if __name__ == "__main__":
    sys.exit(main())
