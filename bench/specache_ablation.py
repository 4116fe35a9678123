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
    totals: dict[str, quality.ContextScore] = {}
    t0 = time.perf_counter()
    for ids in contexts:
        for label, score in quality.score_variants(model, ids, P, variants).items():
            if label in totals:
                totals[label].merge(score)
            else:
                totals[label] = score
    base = totals[quality.BASELINE]
    ppl0 = torch.tensor(base.nll_sum / base.tokens).exp().item()
    print(
        f"SmolLM2-135M, P {P}, T {T}, {args.contexts} context(s) (seed 0); fp16 ppl {ppl0:.3f}; "
        f"{time.perf_counter() - t0:.0f} s"
    )
    print("| variant | ppl | ppl delta | KL (nats/token) | top-1 | stored bits |")
    print("|---|---|---|---|---|---|")
    for label, s in totals.items():
        ppl = torch.tensor(s.nll_sum / s.tokens).exp().item()
        bits = sum(s.stored_bits) / len(s.stored_bits)
        print(
            f"| {label} | {ppl:.3f} | {100 * (ppl / ppl0 - 1):+.2f} % | {s.kl_sum / s.tokens:.4f} | "
            f"{s.agree / s.tokens:.3f} | {bits:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
