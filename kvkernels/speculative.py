"""SpeCache's two-row decode loop (arXiv 2503.16163, Algorithms 2-3), for generate() and for teacher-forced evaluation.

A speculative format (Format.speculative_decode(config), e.g. kvkernels.formats.specache) chooses the next step's
prefetched tokens from the attention of the last query row. Fed one token per step, that row is the current token,
so the choice lags a step. This loop feeds two rows per step instead:

    prefill       the prompt (SDPA, exact; or the part of it the cache does not hold yet); its last logits give T_1
    pre-decode    [T_1] as a speculative row: its attention picks the first top-k set, its logits the guess T'_2;
                  its K/V are dropped (T_1 is fed again in step 1)
    step t        [T_t, T'_{t+1}]: row 0 is the real token (its logits give T_{t+1}, through the logits processors
                  and greedy / sampling as generate() would), row 1 the guess, which sees row 0 (causal) but not
                  vice versa; row 1's attention picks the next top-k set and its logits' argmax is the next guess
                  T'_{t+2}; row 1's K/V are dropped after the forward.

The guess is always the argmax of the raw logits (the most likely token is the best predictor of where the next
step attends), also when sampling. Positions: the cache holds only real tokens between steps, so transformers
numbers the two rows N and N + 1. Decoding two rows costs little more than one when decode is memory-bound (both
rows share every weight and cache read), and on CPU it costs about twice the attention.

Use with generate():

    cache = KVKernelsCache("specache1", config=model.config)
    out = model.generate(ids, past_key_values=cache, custom_generate=specache_decode, max_new_tokens=64)

(an unpadded batch; the model on attn_implementation="kvkernels"); generate_kwargs(cache) gives those extra
arguments for any cache, and kvkernels.integrations.transformers.generate_with_method passes them. Not supported:
padded batches, beam search and prompt-lookup decoding (errors), assisted decoding (transformers drops
assistant_model before a custom_generate callable sees it), returning attentions / hidden states, and streamers
(transformers 5.23 does not forward `streamer` to a custom_generate callable; specache_decode(model, ...) called
directly does stream). return_dict_in_generate returns sequences, scores / logits if asked, and the cache.
"""

from __future__ import annotations

import time

import torch

from .cache import ModelKVCache
from .formats.specache import set_speculative_rows
from .integrations.compat import cache_from, cache_kwarg


def _layer_caches(cache) -> list:
    """The kvkernels layer caches of a KVKernelsCache or ModelKVCache (created layers only)."""
    model_cache = getattr(cache, "model_cache", cache)
    return [layer for layer in getattr(model_cache, "layers", []) if layer is not None]


def is_speculative(cache) -> bool:
    """Whether `cache` (a KVKernelsCache or ModelKVCache; anything else: no) wants the two-row loop
    (Format.speculative_decode of its config)."""
    model_cache = getattr(cache, "model_cache", cache)  # a KVKernelsCache keeps a ModelKVCache (None for fp16)
    if not isinstance(model_cache, ModelKVCache):
        return False
    return model_cache.format.speculative_decode(model_cache.config)


def _check_cache(model, cache) -> None:
    if cache is None or not is_speculative(cache):
        name = type(cache).__name__ if cache is not None else "None"
        raise ValueError(
            "the speculative decode loop needs past_key_values=KVKernelsCache(<a speculative preset such as "
            f"'specache1'>, config=model.config), got {name}"
        )
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "kvkernels":
        raise ValueError(
            f"the speculative decode loop needs the model on attn_implementation='kvkernels' (it is {impl!r}): "
            "the top-k choice happens inside the fused decode attention. Call "
            "kvkernels.integrations.transformers.set_kvkernels_attention(model) first"
        )


def generate_kwargs(cache) -> dict:
    """What generate() needs for `cache`: {"custom_generate": specache_decode} for a speculative format, else {}."""
    return {"custom_generate": specache_decode} if is_speculative(cache) else {}


def speculative_forward(model, cache, ids: torch.Tensor) -> torch.Tensor:
    """One forward of ids [B, n] through `cache` whose last column is a speculative token: it is attended to and
    chooses the next prefetch, and its K/V are dropped afterwards. Returns the logits [B, n, V]."""
    layers = _layer_caches(cache)
    if not layers or layers[0].seq_len == 0:
        raise ValueError("speculative_forward needs a cache that holds the prompt (prefill it first)")
    set_speculative_rows(layers, 1)
    try:
        logits = model(ids, **{cache_kwarg(): cache}, use_cache=True).logits
    finally:
        for layer in _layer_caches(cache):
            if hasattr(layer, "drop_speculative"):
                layer.drop_speculative()
        set_speculative_rows(_layer_caches(cache), 0)
    return logits


def specache_decode(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    **model_kwargs,
):
    """generate()'s decoding loop for speculative caches: pass it as `custom_generate=specache_decode` (module
    docstring). Greedy or sampling per generation_config; logits processors and stopping criteria apply to the
    real tokens as in generate()'s own loop."""
    cache = cache_from(model_kwargs)
    _check_cache(model, cache)
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise NotImplementedError("the speculative decode loop does not support padded batches")
    if synced_gpus:
        raise NotImplementedError("the speculative decode loop does not support synced_gpus")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise NotImplementedError("the speculative decode loop does not return attentions or hidden states")
    # generate() hands a custom_generate callable any mode's configuration: refuse what this loop would silently
    # turn into greedy / sampling per row (transformers drops assistant_model for callables before we see it)
    if (generation_config.num_beams or 1) > 1:
        raise NotImplementedError("the speculative decode loop does not do beam search (num_beams > 1)")
    if generation_config.prompt_lookup_num_tokens is not None:
        raise NotImplementedError("the speculative decode loop does not do prompt-lookup / assisted decoding")
    past = cache.get_seq_length()  # a cache may hold the prompt's first tokens already (one prompt per cache)
    if past >= input_ids.shape[1]:
        raise ValueError(f"the cache holds {past} tokens but the prompt has only {input_ids.shape[1]}")

    pad = generation_config._pad_token_tensor
    has_eos = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    want_dict = generation_config.return_dict_in_generate
    scores = () if want_dict and generation_config.output_scores else None
    raw = () if want_dict and generation_config.output_logits else None
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)

    def choose(logits: torch.Tensor) -> torch.Tensor:
        nonlocal scores, raw
        logits = logits.to(torch.float32)
        processed = logits_processor(input_ids, logits)
        if scores is not None:
            scores += (processed,)
        if raw is not None:
            raw += (logits,)
        if generation_config.do_sample:
            token = torch.multinomial(torch.softmax(processed, dim=-1), num_samples=1).squeeze(1)
        else:
            token = processed.argmax(-1)
        if has_eos:
            token = token * unfinished + pad * (1 - unfinished)
        return token

    def done(token: torch.Tensor) -> bool:
        nonlocal input_ids, unfinished
        input_ids = torch.cat([input_ids, token[:, None]], dim=-1)
        if streamer is not None:
            streamer.put(token.cpu())
        unfinished = unfinished & ~stopping_criteria(input_ids, scores)
        return not bool(unfinished.any())

    with torch.no_grad():
        logits = model(input_ids[:, past:], **{cache_kwarg(): cache}, use_cache=True, logits_to_keep=1).logits[:, -1]
        token = choose(logits)
        finished = done(token)
        guess = None
        if not finished:  # pre-decoding: T_1 alone, as a speculative row
            guess = speculative_forward(model, cache, token[:, None])[:, -1].argmax(-1)
        while not finished:
            logits = speculative_forward(model, cache, torch.stack([token, guess], dim=1))
            guess = logits[:, 1].argmax(-1)
            token = choose(logits[:, 0])
            finished = done(token)
    if streamer is not None:
        streamer.end()
    if not want_dict:
        return input_ids
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores, logits=raw, **{cache_kwarg(): cache})


@torch.inference_mode()
def teacher_forced_logits(model, cache, fed: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """kvkernels.quality.decode_logits for a speculative cache: feed `fed` [T] one real token per step as the
    two-row loop does (pre-decode fed[0], then [fed[i], guess]); returns the real rows' logits [T, V] fp32 and each
    step's wall time (the pre-decode forward counts towards the first step)."""
    _check_cache(model, cache)
    cuda = model.device.type == "cuda"
    fed = fed.to(model.device)
    out, seconds = [], []
    t0 = time.perf_counter()
    guess = speculative_forward(model, cache, fed[:1].view(1, 1))[0, -1].argmax()
    for token in fed:
        logits = speculative_forward(model, cache, torch.stack([token, guess]).view(1, 2))[0]
        guess = logits[1].argmax()
        if cuda:
            torch.cuda.synchronize(model.device)
        seconds.append(time.perf_counter() - t0)
        out.append(logits[0].float())
        t0 = time.perf_counter()
    return torch.stack(out), seconds


__all__ = ["generate_kwargs", "is_speculative", "specache_decode", "speculative_forward", "teacher_forced_logits"]
