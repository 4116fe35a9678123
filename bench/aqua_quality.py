"""AQUA-KV against its own backbone on the eval model: the numbers of docs/FORMATS.md "AQUA-KV".

    python bench/aqua_quality.py [--prefill 512] [--decode-tokens 256] [--contexts 1] [--predictors FILE]
                                 [--ranks 32 64] [--recompute] [--operands bf16] [--only-aqua] [--threads 1]

Scores, on the eval's first contexts (kvkernels.quality, seed 0), teacher-forced through each cache:
    aqua             AQUA-KV 2-bit with the calibrated predictors, mode (b) (calibrated first if FILE is missing:
                     `python -m kvkernels calibrate aqua`, ~4 min on one CPU thread)
    aqua_recompute   (--recompute) mode (a): the same values rebuilt every step; should match aqua
    aqua_bf16 ...    (--operands bf16 fp16) the predictor GEMMs on bf16 / fp16 operands (the op's tensor-core path)
    aqua_rR          (--ranks R ...) mode (c): rank-R predictors (build/aqua/<model>-rR.safetensors, calibrated first
                     if missing: `python -m kvkernels calibrate aqua --rank R`)
    aqua_nopred      the same cache with every predictor zeroed: the backbone alone at the same bits, sinks, commit
    lattice2         the lattice2 preset (G 64, 32 sink + 96 recent fp16 tokens)
    lattice2_w4      lattice2 with AQUA's windows (w_sink 4, w_recent 0)
"""

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from kvkernels import aqua, quality
from kvkernels.integrations.transformers import set_kvkernels_attention


def zero_predictors(preds: aqua.AquaPredictors) -> aqua.AquaPredictors:
    layers = [None] + [
        aqua.LayerPredictors(*(None if t is None else torch.zeros_like(t) for t in dataclasses.astuple(p)))
        for p in preds.layers[1:]
    ]
    return aqua.AquaPredictors(layers, preds.inv_freq, preds.rope_scaling, preds.model, preds.settings)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--contexts", type=int, default=1)
    ap.add_argument("--predictors", type=Path, default=None)
    ap.add_argument("--ranks", type=int, nargs="*", default=[])
    ap.add_argument("--recompute", action="store_true", help="also score mode (a)")
    ap.add_argument("--operands", nargs="*", default=[], choices=["bf16", "fp16"], help="also score these operands")
    ap.add_argument("--only-aqua", action="store_true", help="skip the backbone and lattice2 rows")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = quality.default_model_dir()

    def predictors(rank=None, path=None):
        path = path or aqua.default_predictor_path(model_dir, rank)
        if not Path(path).is_file():
            aqua.main(["aqua", "--out", str(path)] + ([] if rank is None else ["--rank", str(rank)]))
        return aqua.load_predictors(path, model=model)

    model, tok = quality.load_model(progress=False)
    preds = predictors(path=args.predictors)
    set_kvkernels_attention(model)

    P, T = args.prefill, args.decode_tokens
    contexts = quality.build_contexts(quality.load_articles(), quality.text_encoder(tok), P + T + 1, args.contexts)
    variants = [("aqua", "aqua", {"predictors": preds})]
    if args.recompute:
        variants.append(("aqua_recompute", "aqua", {"predictors": preds, "recompute": True}))
    for dt in args.operands:
        variants.append((f"aqua_{dt}", "aqua", {"predictors": preds, "operands": dt}))
    for r in args.ranks:
        variants.append((f"aqua_r{r}", "aqua", {"predictors": predictors(rank=r)}))
    if not args.only_aqua:
        variants += [
            ("aqua_nopred", "aqua", {"predictors": zero_predictors(preds)}),
            ("lattice2", "lattice2", None),
            ("lattice2_w4", "lattice2", {"w_sink": 4, "w_recent": 0}),
        ]
    t0 = time.perf_counter()
    totals = quality.score_contexts(model, contexts, P, variants)
    print(
        f"SmolLM2-135M, P {P}, T {T}, {len(contexts)} context(s) (seed 0); fp16 ppl "
        f"{totals[quality.BASELINE].ppl:.3f}; {time.perf_counter() - t0:.0f} s"
    )
    print(quality.variants_table(totals))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
