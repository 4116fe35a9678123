"""Host time of one layer's dynamic decode step: the Python that runs before each launch, with the kernels stubbed out.

    python bench/host_step.py [--presets innerq_base kivi2 ...] [--head-dim 128] [--json out.json]

Without CUDA graphs (generate() with a dynamic KVKernelsCache), every layer of every decode step pays this on the CPU
before its kernels can launch. The kvkernels ops are replaced by Python stubs that return an output of the right shape
at once, and the caches are tiny (1 batch, 1 KV head, 4 query heads), so what is left is kvkernels' Python: the cache's
bookkeeping, the views it hands the ops, the wrappers' argument checks where a path has them. Not in it: the
dispatcher, the ops' own checks (C++ or Python), the launchers' planning and the launches, which a GPU step pays on
top. Rows per preset, best of 5 timings of 3000 steps, each timing on a fresh cache of 512 tokens (capacity 4096, so
its 3100 appends never reallocate):

  append               QuantizedLayerCache.append of one token (the tails' concatenation, the store write's views)
  fused attention      decode_attention(fused_op=True): one decode_attention_fused call
  composed attention   decode_attention(fused_op=False): two GEMV calls, the window matmuls, softmax, concatenation
                       (these small tensor ops really run, on the CPU; a GPU would launch them instead)
  fused step           append, then fused attention: a decode step as generate() runs it. Not the sum of the two
                       rows above: attention alone on an unchanged cache reuses the stores' views (QuantStore.views
                       keeps them while the store's length and buffers stay), a step after an append cannot for a
                       store that took the new token (InnerQ's keys: every step)

Each row runs twice in the same process: as kvkernels runs it (the ops through ops.unchecked, without the wrappers'
pre-check), and with every ops.unchecked(name) replaced by the public wrapper ops.<name> ("checked twice": the
wrappers' Python pre-check before the op, the path before 2026-11-29). "sdpa fp16" is not stubbed: a DynamicCache-style
update (two torch.cat) and torch SDPA computed on tiny fp32 tensors, dispatcher and CPU arithmetic included, so it is
an upper bound on that path's host time, not a like-for-like row. CPU numbers of this machine; a GPU host's Python may
be faster or slower.
"""

import argparse
import json
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kvkernels  # noqa: E402
from kvkernels import ops  # noqa: E402
from kvkernels.formats import PRESETS, make_layer_cache  # noqa: E402

B, H_KV, H_Q, N = 1, 1, 4, 512
STUBBED = ("decode_attention_fused", "quantize_groups_into", "gemv_inner_q", "gemv_kivi")


class _Stub:
    """Stands in for torch.ops.kvkernels.<op>: .default returns an output of the op's shape at once."""

    def __init__(self, fn):
        self.default = fn


def _gemv_out(x, codes, scales, zeros, bits, group_size, *inner_q_args):
    # gemv_inner_q: one output per code row (M); gemv_kivi: one per token column (words * 32 / bits)
    n = codes.shape[-2] if inner_q_args else codes.shape[-1] * 32 // bits
    return torch.zeros(*x.shape[:-1], n)


def _stubs() -> dict:
    return {
        "decode_attention_fused": _Stub(lambda x, *a: torch.zeros_like(x, dtype=a[-1] or torch.float32)),
        "quantize_groups_into": _Stub(lambda *a: None),
        "gemv_inner_q": _Stub(_gemv_out),
        "gemv_kivi": _Stub(_gemv_out),
    }


def best_us(make, n: int = 3000, repeats: int = 5) -> float:
    """Best of `repeats` timings of n calls of make()'s callable (a fresh one, and so a fresh cache, per timing)."""
    best = float("inf")
    for _ in range(repeats):
        fn = make()
        for _ in range(100):
            fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def preset_rows(preset: str, d: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(B, H_KV, N, d, generator=g).half() for _ in range(2))
    q = torch.randn(B, H_Q, 1, d, generator=g).half()
    k1, v1 = (torch.randn(B, H_KV, 1, d, generator=g).half() for _ in range(2))

    def fresh():  # a new cache of N tokens per timing: the appends of one timing do not lengthen the next one's
        cache = make_layer_cache(PRESETS[preset], B, H_KV, d, capacity=4096, dtype=torch.float16)
        cache.append(k, v)
        return cache

    def step(c):
        def run():
            c.append(k1, v1)
            c.attention(q, fused_op=True)

        return run

    paths = {
        "append": lambda c: lambda: c.append(k1, v1),
        "fused attention": lambda c: lambda: c.attention(q, fused_op=True),
        "composed attention": lambda c: lambda: c.attention(q, fused_op=False),
        "fused step": step,
    }
    rows = {}
    for name, path in paths.items():
        rows[name] = best_us(lambda path=path: path(fresh()))
        with mock.patch.object(ops, "unchecked", lambda op: getattr(ops, op)):  # the wrappers' pre-check again
            rows[f"{name}, checked twice"] = best_us(lambda path=path: path(fresh()))
    return rows


def sdpa_row(d: int) -> float:
    g = torch.Generator().manual_seed(0)
    # fp32: the CPU's fp16 SDPA is slow arithmetic, not host work (a GPU launches the same calls for either dtype)
    kc, vc = (torch.randn(B, H_KV, N, d, generator=g) for _ in range(2))
    q = torch.randn(B, H_Q, 1, d, generator=g)
    k1, v1 = (torch.randn(B, H_KV, 1, d, generator=g) for _ in range(2))

    def step():  # DynamicCache.update (a cat per tensor) + SDPA over the result; the cache does not grow here
        k, v = torch.cat([kc, k1], dim=2), torch.cat([vc, v1], dim=2)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return best_us(lambda: step, n=1000)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["innerq_base", "innerq_small", "kivi2"])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    result = {"device": "cpu (host time only)", "torch": torch.__version__, "kvkernels": kvkernels.__version__,
              "shape": {"B": B, "H_kv": H_KV, "H_q": H_Q, "N": N, "D": a.head_dim}, "rows": {}}  # fmt: skip
    with mock.patch.dict(torch.ops.kvkernels.__dict__, _stubs()):
        for preset in a.presets:
            rows = preset_rows(preset, a.head_dim)
            result["rows"][preset] = rows
            for path in ("append", "fused attention", "composed attention", "fused step"):
                once, twice = rows[path], rows[f"{path}, checked twice"]
                print(f"{preset:>14} {path:<19} {once:6.1f} us (checked twice: {twice:6.1f} us, {twice / once:.2f}x)")
    sdpa = sdpa_row(a.head_dim)
    result["rows"]["sdpa fp16"] = {"step": sdpa}
    print(f"{'sdpa fp16':>14} {'step':<19} {sdpa:6.1f} us (two torch.cat + SDPA, computed in fp32)")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
