"""AQUA-KV against its own backbone on the eval model: the numbers of docs/FORMATS.md "AQUA-KV".

    python bench/aqua_quality.py [--prefill 512] [--decode-tokens 256] [--predictors FILE] [--threads 1]

Scores, on the eval's first context (kvkernels.quality, seed 0), teacher-forced through each cache:
    aqua             AQUA-KV 2-bit with the calibrated predictors (calibrated first if FILE is missing:
                     `python -m kvkernels calibrate aqua`, ~4 min on one CPU thread)
    aqua_nopred      the same cache with every predictor zeroed: the backbone alone at the same bits, sinks, commit
    lattice2         the lattice2 preset (G 64, 32 sink + 96 recent fp16 tokens)
    lattice2_w4      lattice2 with AQUA's windows (w_sink 4, w_recent 0)
"""

import argparse
import time
from pathlib import Path

import torch

from kvkernels import aqua, quality
from kvkernels.integrations.transformers import set_kvkernels_attention


def zero_predictors(preds: aqua.AquaPredictors) -> aqua.AquaPredictors:
    layers = [None] + [
        aqua.LayerPredictors(*(torch.zeros_like(t) for t in (p.key_weight, p.key_bias, p.value_weight, p.value_bias)))
        for p in preds.layers[1:]
    ]
    return aqua.AquaPredictors(layers, preds.inv_freq, preds.rope_scaling, preds.model, preds.settings)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--predictors", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.predictors or aqua.default_predictor_path(quality.default_model_dir())
    if not Path(path).is_file():
        aqua.main(["aqua", "--out", str(path)])
    model, tok = quality.load_model(progress=False)
    preds = aqua.load_predictors(path, model=model)
    set_kvkernels_attention(model)

    P, T = args.prefill, args.decode_tokens
    ids = quality.build_contexts(quality.load_articles(), quality.text_encoder(tok), P + T + 1, 1)[0]
    variants = [
        ("aqua", "aqua", {"predictors": preds}),
        ("aqua_nopred", "aqua", {"predictors": zero_predictors(preds)}),
        ("lattice2", "lattice2", None),
        ("lattice2_w4", "lattice2", {"w_sink": 4, "w_recent": 0}),
    ]
    t0 = time.perf_counter()
    scores = quality.score_variants(model, ids, P, variants)
    ppl0 = torch.tensor(scores[quality.BASELINE].nll_sum / scores[quality.BASELINE].tokens).exp().item()
    print(f"SmolLM2-135M, P {P}, T {T}, 1 context (seed 0); fp16 ppl {ppl0:.3f}; {time.perf_counter() - t0:.0f} s")
    print("| variant | ppl delta | KL (nats/token) | top-1 | stored bits |")
    print("|---|---|---|---|---|")
    for label, s in scores.items():
        ppl = torch.tensor(s.nll_sum / s.tokens).exp().item()
        print(
            f"| {label} | {100 * (ppl / ppl0 - 1):+.2f} % | {s.kl_sum / s.tokens:.4f} | {s.agree / s.tokens:.3f} | "
            f"{s.stored_bits[0]:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
