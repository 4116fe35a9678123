"""Re-examine the format defaults chosen on synthetic data, on the real model's K/V and perplexity (issue 13).

Two measurements on SmolLM2-135M over the Wikipedia contexts kvkernels.quality uses (same seed, same text):

  levels     the signed level set of symmetric InnerQ groups (bench/sym_levels.py's midtread / midrise / twos)
             on the real prefill keys (per-token groups of 32 channels, raw and after key normalization) and
             values (per-channel groups of 32 tokens): relative MSE per layer, averaged.
  ablations  one setting of one preset changed at a time (key normalization, windows, eta, group size), scored by
             teacher-forced decode through the cache against fp16 (quality.score_variants: one prefill and one
             fp16 decode shared by every variant): ppl delta, KL, top-1 agreement.

Run: python bench/real_defaults.py --prefill 2048 --decode-tokens 128 --contexts 2 --out docs/quality/defaults.json
(~25 min on 2 CPU cores). The numbers are quoted in docs/FORMATS.md and docs/QUALITY.md.
"""

import argparse
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import torch

from kvkernels import quality
from kvkernels.integrations.transformers import method_config, set_kvkernels_attention
from kvkernels.keynorm import compute_key_norm

HERE = Path(__file__).resolve().parent

# (label, preset, overrides): the preset's default first, then one change at a time
ABLATIONS = [
    ("innerq_base", "innerq_base", {}),
    ("innerq_base key_norm=False", "innerq_base", {"key_norm": False}),
    ("innerq_base no windows", "innerq_base", {"w_sink": 0, "w_recent": 0}),
    ("innerq_base w_sink=0", "innerq_base", {"w_sink": 0}),
    ("innerq_base w_recent=32", "innerq_base", {"w_recent": 32}),
    ("innerq_base w_recent=128", "innerq_base", {"w_recent": 128}),
    ("innerq_base group_size=64", "innerq_base", {"group_size": 64}),
    ("innerq_hybrid", "innerq_hybrid", {}),
    ("innerq_hybrid key_norm=False", "innerq_hybrid", {"key_norm": False}),
    ("kivi2", "kivi2", {}),
    ("kivi2 w_sink=32", "kivi2", {"w_sink": 32}),
    ("kivi2 eta=0.05", "kivi2", {"eta": 0.05}),
    ("kivi1_eta", "kivi1_eta", {}),
    ("kivi1_eta eta=0", "kivi1_eta", {"eta": 0.0}),
    ("kivi1_eta eta=0.15", "kivi1_eta", {"eta": 0.15}),
    ("kivi1_eta eta=0.35", "kivi1_eta", {"eta": 0.35}),
    ("innerq_asym1_eta", "innerq_asym1_eta", {}),
    ("innerq_asym1_eta key_norm=False", "innerq_asym1_eta", {"key_norm": False}),
]


def _sym_levels():
    spec = importlib.util.spec_from_file_location("sym_levels", HERE / "sym_levels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def level_study(kv_per_context, group_size: int = 32) -> dict:
    """Relative MSE of each signed level set on real keys (per-token groups; raw, and quantized after key
    normalization with the error measured back in the raw domain, as attention sees it) and values (per-channel
    groups of tokens), bits 2 and 3, averaged over layers and contexts."""
    sl = _sym_levels()
    fns = (sl.midtread, sl.midrise, sl.twos)
    sums: dict[str, list[float]] = {}
    for kv in kv_per_context:
        for k, v in kv:
            k, v = k.float(), v.float()  # [1, H, P, D]
            norm = compute_key_norm(k)[None, :, None, :]  # [1, H, 1, D]
            P = k.shape[2] // group_size * group_size
            vt = v[:, :, :P].transpose(-1, -2)  # groups of consecutive tokens of one channel
            # (name, raw data, quantizer input, factor back to the raw domain)
            data = (("keys raw", k, k, 1.0), ("keys normalized", k, k / norm, norm), ("values", vt, vt, 1.0))
            for name, raw, x, factor in data:
                for b in (2, 3):
                    for f in fns:
                        y = f(x.reshape(-1, group_size), b)
                        if y is not None:
                            err = y.reshape(x.shape) * factor - raw
                            sums.setdefault(f"{name}|{b}|{f.__name__}", []).append(
                                float((err**2).sum() / (raw**2).sum())
                            )
    return {key: sum(vals) / len(vals) for key, vals in sums.items()}


def print_levels(levels: dict) -> None:
    print("signed level set, relative MSE on the real prefill K/V (mean over layers and contexts)")
    print(f"{'data':<17} {'bits':>4} {'midtread':>9} {'midrise':>9} {'twos':>9}  best")
    rows = sorted({tuple(key.split("|")[:2]) for key in levels})
    for name, b in rows:
        vals = {f: levels.get(f"{name}|{b}|{f}", math.nan) for f in ("midtread", "midrise", "twos")}
        best = min((v, k) for k, v in vals.items() if v == v)[1]
        print(f"{name:<17} {b:>4} {vals['midtread']:>9.4f} {vals['midrise']:>9.4f} {vals['twos']:>9.4f}  {best}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--contexts", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--only", nargs="*", default=None, help="ablation labels to run (default all)")
    ap.add_argument("--skip-ablations", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("build/eval/defaults.json"))
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    model, tok = quality.load_model()
    set_kvkernels_attention(model)  # the fused decode path, as `kvkernels eval` runs it
    articles = quality.load_articles()
    contexts = quality.build_contexts(
        articles,
        quality.text_encoder(tok),
        a.prefill + a.decode_tokens + 1,
        a.contexts,
        a.seed,
    )
    t0 = time.time()
    kvs = [quality.prefill_kv(model, c[: a.prefill]) for c in contexts]
    levels = level_study(kvs)
    del kvs
    print_levels(levels)
    result = {
        "prefill": a.prefill,
        "decode_tokens": a.decode_tokens,
        "contexts": a.contexts,
        "seed": a.seed,
        "torch": torch.__version__,
        "levels": levels,
        "ablations": {},
    }
    variants = [(lab, m, o) for lab, m, o in ABLATIONS if a.only is None or lab in a.only]
    if not a.skip_ablations:
        merged = quality.score_contexts(
            model, contexts, a.prefill, variants, lambda i, lab: print(f"  context {i + 1}: {lab}", file=sys.stderr)
        )
        base = merged[quality.BASELINE].ppl
        print(f"\nablations: P={a.prefill}, T={a.decode_tokens}, {a.contexts} contexts, fp16 ppl {base:.3f}")
        print(f"{'variant':<34} {'stored bits':>11} {'ppl':>8} {'delta %':>8} {'KL':>7} {'top-1':>6}")
        for lab, method, over in variants:
            s = merged[lab]
            ppl = s.ppl
            row = {
                "preset": method,
                "overrides": over,
                "config": repr(method_config(method, **over)),
                "stored_bits": s.mean_stored_bits,
                "ppl": ppl,
                "ppl_delta_rel": ppl / base - 1,
                "kl": s.kl,
                "top1_agreement": s.top1,
                "tokens": s.tokens,
            }
            result["ablations"][lab] = row
            print(
                f"{lab:<34} {row['stored_bits']:>11.2f} {ppl:>8.3f} {100 * row['ppl_delta_rel']:>+8.2f} "
                f"{row['kl']:>7.4f} {row['top1_agreement']:>6.3f}"
            )
        result["fp16_ppl"] = base
    result["seconds"] = time.time() - t0
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {a.out} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
