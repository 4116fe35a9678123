"""How well SpeCache's speculative top-k predicts where the real next token attends, on the trained eval model.

    python bench/specache_hits.py [--prefill 2048] [--steps 64] [--topk 64] [--threads 1]

Teacher-forced decode of one Wikipedia context (kvkernels.quality: SmolLM2-135M, the eval's first context) through a
specache1 cache with the two-row loop. At every step t and layer, with E_t = the top-k positions of the real row's
attention (mean over each KV group's query heads, the format's own rule) among the positions a quantized store
holds:
    hit rate       |S_t & E_t| / k, S_t = the set the speculative row of step t-1 chose (what is prefetched)
    lagged hit     |E_{t-1} & E_t| / k: choosing from the previous real token's row instead (plain generate())
    mass           the real row's attention mass on S_t, on E_{t-1} and on E_t (the oracle), as a fraction of its
                   mass on the quantized positions: what the override makes exact
    sparsity       the fraction of all cached tokens needed to cover 90 % of the real row's attention (the paper:
                   0.5 % on Llama-3-8B / PG19 at 8k)
Prints per-layer means (a markdown table) and the overall mean.
"""

import argparse
import statistics

import torch

from kvkernels import quality
from kvkernels.integrations.transformers import set_kvkernels_attention
from kvkernels.speculative import teacher_forced_logits


def instrument(layer, stats):
    observe = layer.observe_attention
    state = {"prev_exact": None}

    def wrapped(p):
        if p.shape[2] == 2:  # a two-row step: row 0 is the real token
            row = p[:, :, 0]
            B, Hq, N = row.shape
            mean = row.reshape(B, layer.num_kv_heads, Hq // layer.num_kv_heads, N).mean(2)
            exact = layer.select_topk(row)
            lo, hi = layer.eligible_range()
            quant_mass = mean[..., lo:hi].sum(-1)

            def mass(idx):
                if idx is None:
                    return float("nan")
                valid = idx >= 0
                got = mean.gather(-1, idx.clamp(min=0)) * valid
                return float((got.sum(-1) / quant_mass).mean())

            def hits(a, b):
                if a is None:
                    return float("nan")
                inter = sum(
                    len(set(x.tolist()) & set(y.tolist()) - {-1})
                    for x, y in zip(a.flatten(0, 1), b.flatten(0, 1), strict=True)
                )
                return inter / float((b >= 0).sum())

            spec = layer.override_idx
            full = mean.sort(-1, descending=True).values.cumsum(-1)
            need = (full < 0.9 * full[..., -1:]).sum(-1) + 1
            stats.append({
                "layer": layer.context.layer_idx,
                "hit": hits(spec, exact),
                "lag_hit": hits(state["prev_exact"], exact),
                "mass_spec": mass(spec),
                "mass_lag": mass(state["prev_exact"]),
                "mass_oracle": mass(exact),
                "sparsity": float((need / N).mean()),
            })  # fmt: skip
            state["prev_exact"] = exact
        observe(p)

    layer.observe_attention = wrapped


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--topk", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = quality.load_model(progress=False)
    set_kvkernels_attention(model)
    length = args.prefill + args.steps + 1
    ids = quality.build_contexts(quality.load_articles(), quality.text_encoder(tok), length, 1)[0]
    kv = quality.prefill_kv(model, ids[: args.prefill])
    cache = quality.make_cache("specache1", model, {"topk": args.topk})
    quality.fill_cache(cache, kv)
    stats: list[dict] = []
    for layer in cache.model_cache.layers:
        instrument(layer, stats)
    teacher_forced_logits(model, cache, ids[args.prefill : args.prefill + args.steps])
    keys = ["hit", "lag_hit", "mass_spec", "mass_lag", "mass_oracle", "sparsity"]
    print(f"SmolLM2-135M, P {args.prefill}, {args.steps} teacher-forced steps, specache1 top-{args.topk}")
    print("| layer | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    layers = sorted({s["layer"] for s in stats})
    for i in layers:
        rows = [s for s in stats if s["layer"] == i]
        vals = [statistics.fmean(r[k] for r in rows if r[k] == r[k]) for k in keys]
        print(f"| {i} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    vals = [statistics.fmean(s[k] for s in stats if s[k] == s[k]) for k in keys]
    print("| all | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
