"""AQUA-KV calibration (kvkernels.aqua): the ridge against a float64 solve of the same damped system, Alg. 1 on
reconstructed inputs, RoPE inversion, the predictor file and its fingerprint, and calibration text disjoint from
the eval's."""

import dataclasses
import random

import numpy as np
import pytest
import torch
from cache_helpers import require_real_model, tiny_llama

from kvkernels import aqua, ops, quality

# ---------------------------------------------------------------------------------------------------------
# ridge


def _numpy_ridge(X, Y, reg):
    # the reference's system, written out independently in float64 numpy: ones column, damped Gram, solve
    Xa = np.concatenate([X.numpy().astype(np.float64), np.ones((X.shape[0], 1))], axis=1)
    C = Xa.T @ Xa
    C[np.diag_indices_from(C)] += reg * np.abs(np.diag(C)).mean()
    W_aug = np.linalg.solve(C, Xa.T @ Y.numpy().astype(np.float64))
    return W_aug[:-1].T, W_aug[-1]


@pytest.mark.parametrize("n, d_in, d_out, reg", [(300, 7, 3, 1e-3), (40, 24, 5, 1e-3), (1000, 16, 16, 0.1)])
def test_fit_ridge_matches_float64_solve(n, d_in, d_out, reg):
    g = torch.Generator().manual_seed(n)
    X = torch.randn(n, d_in, generator=g) * torch.linspace(0.1, 5, d_in) + 3.0  # uneven scales, non-zero mean
    Y = X @ torch.randn(d_in, d_out, generator=g) + torch.randn(n, d_out, generator=g) + 2.0
    W, b = aqua.fit_ridge(X, Y, reg)
    W_np, b_np = _numpy_ridge(X, Y, reg)
    assert W.shape == (d_out, d_in) and b.shape == (d_out,) and W.dtype == torch.float32
    np.testing.assert_allclose(W.numpy(), W_np, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b.numpy(), b_np, rtol=1e-5, atol=1e-6)


def test_fit_ridge_damps_the_bias_row():
    # a few samples: the damping of the bias row (and the ones column's N inside the mean) changes the answer,
    # so a version that damps only the weights, or averages only their diagonal, fails this test
    g = torch.Generator().manual_seed(1)
    X, Y = torch.randn(6, 3, generator=g), torch.randn(6, 2, generator=g) + 5.0
    W, b = aqua.fit_ridge(X, Y, reg=0.5)
    Xa = torch.cat([X, torch.ones(6, 1)], 1).double()
    lam = 0.5 * (Xa.T @ Xa).diagonal().abs().mean()
    W_aug = torch.cat([W.T, b[None]], 0).double()
    grad = Xa.T @ (Xa @ W_aug - Y.double()) + lam * W_aug  # stationarity of ||Xa W - Y||^2 + lam ||W_aug||^2
    assert grad.abs().max() < 1e-4
    C = Xa.T @ Xa
    C[:3, :3] += torch.eye(3, dtype=torch.float64) * 0.5 * C.diagonal()[:3].mean()  # bias undamped
    undamped_bias = torch.linalg.solve(C, Xa.T @ Y.double())[-1]
    assert (undamped_bias - b.double()).abs().max() > 1e-2


def test_fit_ridge_recovers_an_exact_linear_map():
    g = torch.Generator().manual_seed(2)
    X, A, c = torch.randn(500, 8, generator=g), torch.randn(4, 8, generator=g), torch.randn(4, generator=g)
    W, b = aqua.fit_ridge(X, X @ A.T + c, reg=1e-9)
    torch.testing.assert_close(W, A, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b, c, atol=1e-5, rtol=1e-5)


def test_fit_ridge_errors():
    with pytest.raises(ValueError, match="one N"):
        aqua.fit_ridge(torch.randn(5, 2), torch.randn(4, 2))
    with pytest.raises(ValueError, match="no samples"):
        aqua.fit_ridge(torch.randn(0, 2), torch.randn(0, 2))
    with pytest.raises(ValueError, match="reg must be"):
        aqua.fit_ridge(torch.randn(5, 2), torch.randn(5, 2), reg=-1)


# ---------------------------------------------------------------------------------------------------------
# RoPE


def test_rope_matches_transformers_and_inverts():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = tiny_llama(head_dim=32)
    rotary = model.model.rotary_emb
    k = torch.randn(1, 2, 9, 32)
    pos = torch.arange(100, 109)
    cos, sin = rotary(k, pos[None])
    _, want = apply_rotary_pos_emb(k, k, cos, sin)
    got = aqua.rope(k, pos, rotary.inv_freq, rotary.attention_scaling)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aqua.rope(got, pos, rotary.inv_freq, inverse=True), k, atol=1e-5, rtol=1e-5)
    assert transformers


# ---------------------------------------------------------------------------------------------------------
# Alg. 1 on captured K/V


def _layered_kv(layers=3, n=600, C=64, seed=0):
    # K/V whose layers depend linearly on the layer below (plus noise and a per-channel offset)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, C, generator=g)
    v = torch.randn(n, C, generator=g)
    out = [(k, v)]
    for _ in range(1, layers):
        A = torch.randn(C, C, generator=g) / C**0.5
        B = torch.randn(2 * C, C, generator=g) / (2 * C) ** 0.5
        k = k @ A + 0.3 * torch.randn(n, C, generator=g) + torch.randn(C, generator=g)
        v = torch.cat([k, v], 1) @ B + 0.3 * torch.randn(n, C, generator=g)
        out.append((k, v))
    return out


SMALL = aqua.CalibrationSettings(backbone=aqua.Backbone(group_size=32))


def test_calibration_fits_on_reconstructed_inputs():
    kv = _layered_kv()
    train = [(k[:500], v[:500]) for k, v in kv]
    valid = [(k[500:], v[500:]) for k, v in kv]
    preds, stats = aqua.calibrate_on_kv(train, valid, SMALL, progress=False)
    assert preds[0] is None and len(preds) == 3
    # layer 1's predictors, recomputed from layer 0's 4-bit reconstruction (Alg. 1), are the calibrated ones
    bb = SMALL.backbone
    grid, G, signs = bb.args(0, "cpu")
    k0, v0 = (ops.lattice_dequantize(*bb.quantize(x, 0), grid, G, signs) for x in train[0])
    wk, bk = aqua.fit_ridge(k0, train[1][0])
    assert torch.equal(preds[1].key_weight, wk) and torch.equal(preds[1].key_bias, bk)
    exact_wk, _ = aqua.fit_ridge(train[0][0], train[1][0])
    assert not torch.equal(preds[1].key_weight, exact_wk)  # not fitted on the exact layer below
    grid1, G1, signs1 = bb.args(1, "cpu")
    k1 = ops.aqua_reconstruct(k0, wk, bk, *bb.quantize(train[1][0] - (k0 @ wk.T + bk), 1), grid1, G1, signs1)
    wv, bv = aqua.fit_ridge(torch.cat([k1, v0], 1), train[1][1])  # keys first
    assert torch.equal(preds[1].value_weight, wv) and torch.equal(preds[1].value_bias, bv)
    # held-out statistics: strong predictors, and the reconstruction beats the backbone alone at the same bits
    for s in stats[1:]:
        assert s["key_ev"] > 0.8 and s["value_ev"] > 0.5
        assert s["key_bits"] > s["key_backbone_bits"] + 0.5
        assert s["value_bits"] > s["value_backbone_bits"]
    assert stats[0]["key_ev"] is None and stats[0]["key_bits"] == stats[0]["key_backbone_bits"]
    assert "mean layers 1..2" in aqua.format_stats(stats)


def test_reduce_rank_is_exact_for_a_low_rank_map_and_optimal_otherwise():
    g = torch.Generator().manual_seed(3)
    X = torch.randn(400, 12, generator=g) + 2.0  # a non-zero mean: the bias must absorb it
    W = torch.randn(10, 3, generator=g) @ torch.randn(3, 12, generator=g)  # rank 3
    b = torch.randn(10, generator=g)
    up, down, bias = aqua.reduce_rank(X, W, b, 3)
    assert up.shape == (10, 3) and down.shape == (3, 12)
    torch.testing.assert_close(X @ down.T @ up.T + bias, X @ W.T + b, rtol=1e-5, atol=1e-4)
    # a full-rank map: the rank-r predictions' error is the discarded eigenvalues of the centered predictions
    W = torch.randn(10, 12, generator=g)
    up, down, bias = aqua.reduce_rank(X, W, b, 4)
    full = (X @ W.T + b).double()
    err = float(((X @ down.T @ up.T + bias).double() - full).square().sum())
    eig = torch.linalg.eigvalsh((full - full.mean(0)).T @ (full - full.mean(0)))  # ascending
    assert err == pytest.approx(float(eig[:-4].sum()), rel=1e-4)
    assert torch.allclose(up.T @ up, torch.eye(4), atol=1e-5)  # orthonormal columns
    with pytest.raises(ValueError, match="both given"):
        aqua.LayerPredictors(W, b, W, b, key_down=down)
    for bad in (0, 10, 2.5, True):
        with pytest.raises(ValueError, match="rank must be"):
            aqua.reduce_rank(X, W, b, bad)
    with pytest.raises(ValueError, match="rank must be"):
        aqua.CalibrationSettings(rank=0)


def test_reduced_rank_calibration_chains_rank_r_reconstructions():
    kv = _layered_kv()
    train = [(k[:500], v[:500]) for k, v in kv]
    valid = [(k[500:], v[500:]) for k, v in kv]
    settings = dataclasses.replace(SMALL, rank=16)
    preds, stats = aqua.calibrate_on_kv(train, valid, settings, progress=False)
    full, full_stats = aqua.calibrate_on_kv(train, valid, SMALL, progress=False)
    # layer 1 is fitted on the same (layer-0) inputs: its keys are the rank-16 reduction of the full fit
    bb = SMALL.backbone
    grid, G, signs = bb.args(0, "cpu")
    k0 = ops.lattice_dequantize(*bb.quantize(train[0][0], 0), grid, G, signs)
    up, down, bias = aqua.reduce_rank(k0, full[1].key_weight, full[1].key_bias, 16)
    assert torch.equal(preds[1].key_weight, up) and torch.equal(preds[1].key_down, down)
    assert torch.equal(preds[1].key_bias, bias)
    # the predictor reads [k_hat ; v_prev] through value_down [16, 2C]: operands() contracts it before the op
    z, w, a2, w2 = preds[1].operands("value", torch.ones(2, 64), torch.zeros(2, 64))
    assert z.shape == (2, 16) and w.shape == (64, 16) and a2 is None and w2 is None
    # rank 16 of 64 channels explains less than full rank, and still beats the backbone alone
    for s, f in zip(stats[1:], full_stats[1:], strict=True):
        assert s["key_ev"] < f["key_ev"] and s["key_bits"] > s["key_backbone_bits"]


# ---------------------------------------------------------------------------------------------------------
# end to end on a tiny random model: text, capture, file, fingerprint


class _CharTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(ch) % 128 for ch in text]}


def _articles(n, seed=0):
    rng = random.Random(seed)
    return [f"a{i} " + "".join(rng.choice("abcdefgh ") for _ in range(96)) for i in range(n)]


TINY = dataclasses.replace(SMALL, tokens=256, valid_tokens=128, seqlen=128)


def _same(x, y):
    return x is None and y is None or x is not None and y is not None and torch.equal(x, y)


@pytest.mark.parametrize("rank", [None, 8])
def test_calibrate_save_load_and_fingerprint(tmp_path, rank):
    model = tiny_llama(head_dim=32, layers=3, kv_heads=2)
    articles = _articles(1200)
    settings = dataclasses.replace(TINY, rank=rank)
    preds = aqua.calibrate(model, _CharTokenizer(), articles, settings, progress=False, corpus_name="fake")
    assert preds.num_layers == 3 and preds.channels == 64 and len(preds.stats) == 3
    assert preds.settings["eval_articles_excluded"] > 300  # the default full eval's articles were looked at
    assert preds.settings["rank"] == rank and all(p.rank == rank for p in preds.layers[1:])
    if rank:
        assert preds.layers[1].key_weight.shape == (64, rank) and preds.layers[1].value_down.shape == (rank, 128)
    path = preds.save(tmp_path / "p.safetensors")
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:  # a reader that predates rank files refuses them by name
        assert f.metadata()["format"] == (aqua.SCHEMA if rank is None else aqua.SCHEMA_LOW_RANK)
    back = aqua.load_predictors(path, model=model)
    for a, b in zip(preds.layers[1:], back.layers[1:], strict=True):
        assert all(_same(x, y) for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b), strict=True))
    with pytest.raises(ValueError, match="rank must be < C = H_kv \\* head_dim = 64"):
        aqua.calibrate(model, _CharTokenizer(), articles, dataclasses.replace(TINY, rank=64), progress=False)
    assert torch.equal(back.inv_freq, model.model.rotary_emb.inv_freq.float())
    assert back.settings["backbone"]["group_size"] == 32 and back.backbone == TINY.backbone
    other = tiny_llama(head_dim=32, layers=4, kv_heads=2)
    with pytest.raises(ValueError, match="num_hidden_layers: calibrated for 3"):
        aqua.load_predictors(path, config=other.config)
    reseeded = tiny_llama(head_dim=32, layers=3, kv_heads=2, seed=1)
    aqua.load_predictors(path, config=reseeded.config)  # same architecture: the config alone cannot tell
    with pytest.raises(ValueError, match="k_proj weight"):
        aqua.load_predictors(path, model=reseeded)
    with pytest.raises(FileNotFoundError, match="calibrate aqua"):
        aqua.load_predictors(tmp_path / "missing.safetensors")


def test_calibration_articles_are_not_the_evals():
    articles = _articles(1200)
    tok = _CharTokenizer()

    def encode(text):
        return tok(text)["input_ids"]

    _, used = aqua.calibration_windows(articles, encode, 128, 40)
    need = max(quality.FULL_PREFILL) + quality.FULL_DECODE + 1
    eval_used = aqua.eval_article_indices(articles, encode, need, quality.FULL_CONTEXTS)
    assert used and eval_used and not set(used) & eval_used


def test_calibrate_refuses_text_the_eval_reads():
    model = tiny_llama(head_dim=32, layers=2, kv_heads=2)
    articles = _articles(340)  # the default eval reads ~320 of them from the front; calibration needs ~50
    settings = dataclasses.replace(TINY, tokens=4096)
    with pytest.raises(ValueError, match="overlap the default eval"):
        aqua.calibrate(model, _CharTokenizer(), articles, settings, progress=False)


# ---------------------------------------------------------------------------------------------------------
# the real model


def test_real_corpus_calibration_text_is_disjoint_from_eval():
    require_real_model()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(quality.default_model_dir(), local_files_only=True)
    articles = quality.load_articles()

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    d = aqua.CalibrationSettings()
    n_windows = -(-d.tokens // d.seqlen) + -(-d.valid_tokens // d.seqlen)
    _, used = aqua.calibration_windows(articles, encode, d.seqlen, n_windows)
    need = max(quality.FULL_PREFILL) + quality.FULL_DECODE + 1
    for seed in (0,):
        eval_used = aqua.eval_article_indices(articles, encode, need, quality.FULL_CONTEXTS, seed=seed)
        assert not set(used) & eval_used


@pytest.mark.slow
def test_cli_calibrates_the_real_model(tmp_path, capsys):
    require_real_model()
    out = tmp_path / "smollm2.safetensors"
    argv = ["aqua", "--tokens", "2048", "--valid-tokens", "1024", "--seqlen", "1024", "--out", str(out)]
    assert aqua.main([*argv, "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "mean layers 1..29" in printed and "disjoint" in printed
    preds = aqua.load_predictors(out)
    assert preds.num_layers == 30 and preds.channels == 192
    rest = preds.stats[1:]
    assert all(s["key_ev"] > 0.2 and s["value_ev"] > 0.1 for s in rest)
    assert sum(s["key_bits"] - s["key_backbone_bits"] for s in rest) / len(rest) > 0.5
