"""XQuant's Figure 2 statistic on the evaluation model: how similar are adjacent layers' quantized KV codes?

XQuant (arXiv 2510.11236, sec. 3.3.2) shares codes between layers 2j and 2j+1 because, on Mistral-7B, more than 80 % of
2-bit KIVI codes differ by at most 1 between adjacent layers and more than 80 % of 1-bit codes are identical. This
script measures the same on SmolLM2-135M (kvkernels eval's model) over one 2048-token Wikipedia context:
keys per channel (groups of 32 tokens), values per token (groups of 32 channels), asym, no eta (codes do not
depend on eta). It prints the fractions per pair and their mean, and the same for random layer pairs as a floor.

    python bench/xquant_layer_similarity.py            (needs the eval model: python -m kvkernels eval --install)
"""

import torch

import kvkernels
from kvkernels import quality
from kvkernels.reference.packing import unpack_bits

G = 32


def codes(x: torch.Tensor, bits: int) -> torch.Tensor:
    c, _, _ = kvkernels.quantize_groups(x.contiguous(), bits, G, "asym")
    return unpack_bits(c, bits).long()


def main() -> None:
    torch.manual_seed(0)
    model, tok = quality.load_model(progress=False)
    (ctx,) = quality.build_contexts(quality.load_articles(), lambda s: tok(s)["input_ids"], 2048, 1, seed=0)
    with torch.no_grad():
        kv = quality.prefill_kv(model, ctx)
    L = len(kv)
    pairs = [(2 * j, 2 * j + 1) for j in range(L // 2)]
    rand = [tuple(torch.randperm(L)[:2].tolist()) for _ in range(len(pairs))]
    print(f"SmolLM2-135M, {L} layers, one 2048-token context; KIVI layouts, asym, G={G}")
    print(f"{'tensor':6s} {'pairs':10s} {'2-bit |diff|<=1':>16s} {'2-bit equal':>12s} {'1-bit equal':>12s}")
    for name, idx, layout in (("keys", 0, "cols"), ("values", 1, "rows")):
        for label, which in (("(2j,2j+1)", pairs), ("random", rand)):
            near2 = eq2 = eq1 = 0.0
            for a, b in which:
                xa, xb = kv[a][idx].float(), kv[b][idx].float()
                if layout == "cols":  # per channel: groups run along tokens
                    xa, xb = xa.transpose(2, 3), xb.transpose(2, 3)
                ca2, cb2, ca1, cb1 = codes(xa, 2), codes(xb, 2), codes(xa, 1), codes(xb, 1)
                near2 += float(((ca2 - cb2).abs() <= 1).float().mean())
                eq2 += float((ca2 == cb2).float().mean())
                eq1 += float((ca1 == cb1).float().mean())
            n = len(which)
            print(f"{name:6s} {label:10s} {near2 / n:16.3f} {eq2 / n:12.3f} {eq1 / n:12.3f}")


if __name__ == "__main__":
    main()
