"""What SpeCache's pieces buy on the eval model: the speculative row vs choosing from the current token's row, and
the prefetch itself (top-0), on the eval's contexts (kvkernels.quality, seed 0).

    python bench/specache_ablation.py [--prefill 2048] [--decode-tokens 256] [--contexts 2] [--preset specache1]

Variants (labels): PRESET (two-row loop, the paper), PRESET_lagged (two_rows=False: plain one-row decoding, the set
chosen by the previous token's row), PRESET_top0 (topk=0: KIVI at residual 64, what is left without the prefetch).
The full-preset rows and the equal-memory KIVI presets are in the eval's table (python -m kvkernels eval).
"""

import argparse
import time

import torch

from kvkernels import quality
from kvkernels.integrations.transformers import set_kvkernels_attention


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--contexts", type=int, default=2)
    ap.add_argument("--preset", default="specache1")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = quality.load_model(progress=False)
    set_kvkernels_attention(model)

    P, T, name = args.prefill, args.decode_tokens, args.preset
    contexts = quality.build_contexts(quality.load_articles(), quality.text_encoder(tok), P + T + 1, args.contexts)
    variants = [
        (name, name, None),
        (f"{name}_lagged", name, {"two_rows": False}),
        (f"{name}_top0", name, {"topk": 0}),
    ]
    t0 = time.perf_counter()
    totals = quality.score_contexts(model, contexts, P, variants)
    print(
        f"SmolLM2-135M, P {P}, T {T}, {args.contexts} context(s) (seed 0); fp16 ppl "
        f"{totals[quality.BASELINE].ppl:.3f}; {time.perf_counter() - t0:.0f} s"
    )
    print(quality.variants_table(totals))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
