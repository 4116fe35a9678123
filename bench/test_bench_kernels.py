"""pytest-benchmark sweeps of the decode GEMVs (same cases as `python -m kvkernels bench`).

    pytest bench/ --benchmark-json=bench.json                 # CPU: a tiny subset (batch 1, seqlen 512)
    pytest bench/ -k "innerq and cuda" --benchmark-json=...   # GPU: the full grid; GPU-size cases skip on CPU

Each benchmark is one GEMV (scores q.K^T or output p.V) of one method/backend/batch/seqlen, on the Llama-3.1-8B
decode shape. On CUDA one round replays a CUDA graph over L2-exceeding rotated inputs and synchronizes, so the
per-call time is the round time / extra_info["calls_per_round"]; extra_info also holds the compulsory bytes
and GB/s. CI only runs tests/, not bench/.
"""

import pytest
import torch

from kvkernels import bench as B

HAS_CUDA = torch.cuda.is_available()
SHAPE = B.SHAPES["llama-3.1-8b"]
CPU_GRID = {(1, 512)}  # (batch, seqlen) cases that run without a GPU
GRID = sorted(CPU_GRID | {(b, n) for b in (1, 8) for n in (4096, 32768, 131072)})
BACKENDS = ("cuda", "triton", "reference") if HAS_CUDA else ("cpp",)


def _cases():
    for m in B.METHODS.values():
        for be in ("torch",) if m.op is None else BACKENDS:
            for b, n in GRID:
                for part in ("scores", "output"):
                    marks = [] if HAS_CUDA or (b, n) in CPU_GRID else [pytest.mark.skip(reason="GPU-size case")]
                    yield pytest.param(m.name, be, b, n, part, id=f"{m.name}-{be}-B{b}-N{n}-{part}", marks=marks)


@pytest.mark.parametrize(("method", "backend", "batch", "seqlen", "part"), list(_cases()))
def test_gemv(benchmark, method, backend, batch, seqlen, part):
    device = torch.device("cuda" if HAS_CUDA else "cpu")
    m = B.METHODS[method]
    impl, reason = B.resolve_impl(m, backend, device)
    if reason:
        pytest.skip(reason)
    if backend == "reference" and HAS_CUDA and batch * seqlen > B.REFERENCE_MAX_TOKENS_GPU:
        pytest.skip(f"reference on GPU limited to batch*seqlen <= {B.REFERENCE_MAX_TOKENS_GPU}")
    (p,) = [x for x in B.build_parts(m, backend, SHAPE, batch, seqlen, device) if x.name == part]
    if p.ref_fn is not None:  # never time a wrong kernel
        assert B._rel_err(p.fn(p.inputs), p.ref_fn(p.inputs)) < B.ERR_TOL
    if HAS_CUDA:
        sets = B.rotated_sets(p, B._l2_bytes(device))
        replay, info = B.cuda_step(p.fn, sets)

        def step():
            replay()
            torch.cuda.synchronize()

        rounds = 50
    else:
        sets, info = [p.inputs], {"timer": "perf_counter"}

        def step():
            p.fn(p.inputs)

        rounds = 5
    benchmark.extra_info.update(
        {"bytes": p.bytes, "calls_per_round": len(sets), "timer": info["timer"], "device": device.type}
    )
    if not HAS_CUDA:
        benchmark.extra_info["note"] = B.CPU_WARNING
    benchmark.pedantic(step, rounds=rounds, warmup_rounds=2, iterations=1)
    if benchmark.stats is not None:  # None under --benchmark-disable (the step ran once, untimed)
        med = benchmark.stats.stats.median / len(sets)
        benchmark.extra_info["GBps"] = p.bytes / med / 1e9
