"""Helpers shared by the layer-cache tests (test_layer_cache.py, test_format_<name>.py)."""

import torch

from kvkernels.formats import format_of, make_layer_cache


def make_cache(config, B=1, H=2, D=64, capacity=64, dtype=torch.float32, device="cpu", **kw):
    return make_layer_cache(config, B, H, D, capacity=capacity, device=device, dtype=dtype, **kw)


def kv(B, H, N, D, seed=0, outliers=False):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g)
    if outliers:
        k[..., 3] *= 20
        k[..., 3 + D // 2] *= 20
    return k, v


def expected_counts(config, total):
    """Closed form of the window state of a cache that was only ever appended to (no crop).

    A "rows" store takes tokens one at a time, a "cols" store in whole groups of G (kvkernels.formats.base)."""
    G, w = config.group_size, config.w_recent
    fmt = format_of(config)
    k_step, v_step = (1 if layout == "rows" else G for layout in (fmt.key_layout, fmt.value_layout))
    sink = min(total, config.w_sink)
    rest = total - sink
    kq = max(0, (rest - w) // k_step * k_step)
    vq = max(0, (rest - w) // v_step * v_step)
    return {
        "sink": sink,
        "key_quantized": kq,
        "key_tail": rest - kq,
        "value_quantized": vq,
        "value_tail": rest - vq,
        "total": total,
    }


def tiny_llama(head_dim=32, layers=2, heads=4, kv_heads=2, vocab=128, hidden=None, attn="kvkernels", seed=0):
    """A random-init LlamaForCausalLM for integration tests (no special tokens, eval mode), on `attn`."""
    import pytest

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=hidden or heads * head_dim,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    if attn == "kvkernels":
        from kvkernels.integrations.transformers import set_kvkernels_attention

        set_kvkernels_attention(model)
    else:
        model.set_attn_implementation(attn)
    return model


def require_real_model() -> None:
    """Skip unless the eval's model and corpus packages are installed (or the model is already converted)."""
    import pytest

    from kvkernels import quality

    try:
        quality.package_file(quality.CORPUS_MODULE, quality.CORPUS_FILE, quality.CORPUS_PIP)
        if not quality.is_converted(quality.default_model_dir()):
            quality.package_file(quality.MODEL_MODULE, quality.GGUF_FILE, quality.MODEL_PIP)
    except quality.MissingDependencyError as e:
        pytest.skip(f"model/corpus package not installed ({quality.INSTALL_HINT}, or `make eval`): {e}")
