"""A few calls of the CUDA GEMVs at one shape, for Nsight Compute (bench/gpu_verify.sh's `ncu` stage):

    ncu --clock-control none -k regex:gemv --section SpeedOfLight ... \\
        python bench/ncu_gemv.py --methods innerq-base kivi2 --seqlen 131072 --batch 1

Each method's scores and output GEMV (Llama-3.1-8B attention shape, the inputs `python -m kvkernels bench` times)
run `--calls` times each; ncu's launch filter picks which calls it profiles. The first GPU run (H200, 2026-11-26)
measured the value-side GEMVs (InnerQ values, both KIVI GEMVs) at 0.4-0.8 TB/s marginal, against 2.2-2.9 TB/s for the
InnerQ key GEMVs: ncu's memory throughput, occupancy and warp stall reasons say why.
"""

import argparse

import torch

from kvkernels import bench


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--methods", nargs="+", choices=list(bench.METHODS), default=["innerq-base", "kivi2"])
    p.add_argument("--seqlen", type=int, default=131072)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--calls", type=int, default=2)
    a = p.parse_args()
    dev = torch.device("cuda")
    for name in a.methods:
        m = bench.METHODS[name]
        impl, why = bench.resolve_impl(m, "cuda", dev)
        if impl is None:
            print(f"{name}: skipped ({why})")
            continue
        for part in bench.build_parts(m, "cuda", bench.SHAPES["llama-3.1-8b"], a.batch, a.seqlen, dev):
            for _ in range(a.calls):
                part.fn(part.inputs)
            torch.cuda.synchronize()
            print(f"{name} {part.name}: {a.calls} calls, {part.bytes / 1e6:.1f} MB compulsory per call", flush=True)


if __name__ == "__main__":
    main()
