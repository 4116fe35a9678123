"""AQUA-KV predictors: the closed-form ridge, calibration (Alg. 1) on a trained model, and the predictor file.

AQUA-KV (arXiv 2501.19392; docs/FORMATS.md "AQUA-KV"; research notes batch2.md section 3) predicts each layer's
keys and values from the layer below and stores only the quantized residual:

    k_hat_l = f_k(k_hat_{l-1}) + deq(Q(k_l - f_k(k_hat_{l-1})))
    v_hat_l = f_v([k_hat_l ; v_hat_{l-1}]) + deq(Q(v_l - f_v([k_hat_l ; v_hat_{l-1}])))     (keys first)

per token, on all KV heads of the token concatenated (C = H_kv * head_dim channels), keys before RoPE. Layer 0 has no
predictor and is quantized directly at `first_layer_bits` (4).

Calibration (Alg. 1, as the reference code runs it): capture every layer's exact k_proj / v_proj outputs (pre-RoPE
keys, values) on calibration text, then go up the layers in order, fitting each layer's predictors on the
*reconstructed* K/V of the layer below (quantization error included, as inference will see it) against the exact
K/V, quantizing the residual with the backbone and reconstructing, which becomes the next layer's input. The exact
model runs once; quantization error is not fed back into the residual stream (the reference does not either).

Backbone: the lattice format (HIGGS-style, kvkernels.formats.lattice) per KV head: groups of G = 64 channels (one
head of SmolLM2 / Llama; lattice groups are powers of two, and 192 = 3 x 64 is not one), 2-bit EDEN2-16 grid by
default, layer 0 at 4 bits (EDEN2-256). Each group costs its codes + one fp16 norm: 2.25 / 4.25 bits per value.

Ridge (aquakv/linear_utils.py::fit_linear_regression with reg_rate = 1e-3): X gets a ones column (the bias), the
damping 1e-3 * mean |diag(X^T X)| is added to every diagonal entry, the bias row included, and W = pinv(C) X^T Y.
The Gram matrix and the solve run in float64 here (the reference: fp32 on a GPU); the weights are stored fp32.

Calibration text is disjoint from the evaluation's (kvkernels.quality): the eval reads articles from the front of
its seeded shuffle (seed 0 by default), calibration reads them from the back of the seed-0 shuffle, and calibrate()
checks that the articles the default full eval reads (4 contexts of 7680 + 256 + 1 tokens) are not among its own.

The predictor file is safetensors: per layer l >= 1 `layers.l.key.weight` [C, C], `layers.l.key.bias` [C],
`layers.l.value.weight` [C, 2C] (input [k_hat ; v_prev_hat], the reference's order and layout), `layers.l.value.bias`
[C], all fp32, plus `rope.inv_freq` [head_dim / 2] (the cache un-rotates post-RoPE keys with it). A rank-r file
(mode (c), `--rank r`: reduce_rank of each ridge fit) holds the factors instead: `key.weight` [C, r] with
`key.down` [r, C], `value.weight` [C, r] with `value.down` [r, 2C]. The metadata holds
JSON: the fingerprint (model config fields + a digest of layer 0's k_proj weight, the calibration settings) and the
held-out statistics. load_predictors(path, config=...) refuses a model whose fingerprint differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ._validate import is_int

SCHEMA = "kvkernels-aqua/1"  # full-rank predictors (what readers before rank files know)
SCHEMA_LOW_RANK = "kvkernels-aqua/2"  # rank-r files: key.weight / value.weight are [C, r], with key.down / value.down
# the model config fields a predictor file is bound to (a different value means different K/V statistics or shapes)
FINGERPRINT_FIELDS = (
    "model_type",
    "num_hidden_layers",
    "num_key_value_heads",
    "num_attention_heads",
    "head_dim",
    "hidden_size",
    "vocab_size",
    "rope_parameters",
)


# ---------------------------------------------------------------------------------------------------------
# the ridge regression


def fit_ridge(
    X: torch.Tensor, Y: torch.Tensor, reg: float = 1e-3, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form ridge with an intercept, damped as AQUA-KV's reference: (W [D_out, D_in], b [D_out]), fp32.

    X [N, D_in], Y [N, D_out]. With X_aug = [X, 1] and C = X_aug^T X_aug (in `dtype`, float64 by default):
    C[i, i] += reg * mean_i |C[i, i]| for every i, the bias row included (its diagonal, N, enters the mean too);
    W_aug = pinv(C) @ X_aug^T Y; W = W_aug[:-1]^T, b = W_aug[-1].
    """
    if X.dim() != 2 or Y.dim() != 2 or X.shape[0] != Y.shape[0]:
        raise ValueError(f"fit_ridge: X [N, D_in] and Y [N, D_out] with one N, got {list(X.shape)} / {list(Y.shape)}")
    if X.shape[0] == 0:
        raise ValueError("fit_ridge: no samples")
    if not reg >= 0:
        raise ValueError(f"fit_ridge: reg must be >= 0, got {reg!r}")
    Xa = torch.cat([X.to(dtype), torch.ones(X.shape[0], 1, dtype=dtype, device=X.device)], dim=1)  # [N, D_in + 1]
    C = Xa.T @ Xa
    C.diagonal().add_(reg * C.diagonal().abs().mean())
    W_aug = torch.linalg.pinv(C) @ (Xa.T @ Y.to(dtype))  # [D_in + 1, D_out]
    return W_aug[:-1].T.to(torch.float32).contiguous(), W_aug[-1].to(torch.float32).contiguous()


def explained_variance(pred: torch.Tensor, target: torch.Tensor) -> float:
    """1 - ||pred - target||^2 / ||target - mean(target)||^2 (per-channel means over the tokens), float64."""
    t = target.double()
    return 1.0 - float((pred.double() - t).square().sum() / (t - t.mean(0)).square().sum())


def rel_mse(approx: torch.Tensor, target: torch.Tensor) -> float:
    """||approx - target||^2 / ||target||^2 (the reference's relMSE; -log4 of it is its "equivalent bits")."""
    t = target.double()
    return float((approx.double() - t).square().sum() / t.square().sum())


def equivalent_bits(rmse: float) -> float:
    return -math.log(rmse, 4) if rmse > 0 else math.inf


# ---------------------------------------------------------------------------------------------------------
# RoPE (Llama's rotate-half convention), to un-rotate the post-RoPE keys a cache receives


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope(
    k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0, inverse: bool = False
) -> torch.Tensor:
    """Llama RoPE of k [..., T, D] at integer positions [T], fp32: a (k cos + rotate_half(k) sin), cos/sin of
    positions * inv_freq repeated twice along D, a = the attention scaling; inverse=True undoes it exactly up to
    rounding ((k cos - rotate_half(k) sin) / a: each pair rotates back by the same angle)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]  # [T, D / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    kf = k.to(torch.float32)
    if inverse:
        return (kf * cos - _rotate_half(kf) * sin) / scaling
    return (kf * cos + _rotate_half(kf) * sin) * scaling


# ---------------------------------------------------------------------------------------------------------
# the backbone quantizer


@dataclass(frozen=True)
class Backbone:
    """The residual quantizer: lattice codes per group of G channels of a token, `bits` per value (first layer:
    first_layer_bits), EDEN grids of dimension `dim`, optional seeded Hadamard signs."""

    bits: int = 2
    first_layer_bits: int = 4
    dim: int = 2
    group_size: int = 64
    signs_seed: int | None = None

    def lattice_config(self, layer: int):
        """The lattice format's config of layer's codes (through the registry: this module names no format)."""
        from .formats import get_format

        bits = self.first_layer_bits if layer == 0 else self.bits
        return get_format("lattice").config_type(
            bits=bits, dim=self.dim if bits == 2 else 2, group_size=self.group_size, signs_seed=self.signs_seed
        )

    def quantize(self, x: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, C] -> (codes int32 [T, C * bits / 32], norms fp16 [T, C / G])."""
        from . import ops
        from .formats.lattice_grids import grid

        cfg = self.lattice_config(layer)
        g = grid(cfg.dim, cfg.grid_points).to(x.device)
        return ops.lattice_quantize(x.contiguous(), g, cfg.group_size, cfg.signs(x.device), check_values=False)

    def args(self, layer: int, device) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """(grid, group_size, signs) of layer's codes, as the ops take them."""
        from .formats.lattice_grids import grid

        cfg = self.lattice_config(layer)
        return grid(cfg.dim, cfg.grid_points).to(device), cfg.group_size, cfg.signs(device)


# ---------------------------------------------------------------------------------------------------------
# predictors


@dataclass
class LayerPredictors:
    """Layer l >= 1's two predictors, fp32, full rank or rank r (mode (c), reduce_rank).

    Full rank (key_down, value_down None): key_weight [C, C], value_weight [C, 2C] on [k_hat_l ; v_hat_{l-1}] (keys
    first). Rank r: the prediction is up @ (down @ x): key_down [r, C] and key_weight [C, r]; value_down [r, 2C] and
    value_weight [C, r]. The biases are [C] either way.
    """

    key_weight: torch.Tensor
    key_bias: torch.Tensor
    value_weight: torch.Tensor
    value_bias: torch.Tensor
    key_down: torch.Tensor | None = None
    value_down: torch.Tensor | None = None

    def __post_init__(self):
        if (self.key_down is None) != (self.value_down is None):
            raise ValueError("LayerPredictors: key_down and value_down are both given (rank r) or both None")

    @property
    def rank(self) -> int | None:
        """None for full-rank predictors, else r."""
        return None if self.key_down is None else self.key_down.shape[0]

    def operands(
        self, which: str, prev: torch.Tensor, prev_v: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(a, w, a2, w2): the prediction of `which` ("key": prev = k_hat_{l-1}; "value": prev = k_hat_l, prev_v =
        v_hat_{l-1}) is a @ w^T (+ a2 @ w2^T) + bias, aqua_reconstruct's GEMM operands. Full rank: the inputs and
        the weight (the value weight split column-wise, so [k_hat ; v_prev_hat] is never formed). Rank r: the
        projected input z = down @ x [T, r] (a small GEMM per input) and up. Inputs are cast to the weights' dtype:
        fp16 / bf16 weights put the op on tensor cores (AquaConfig.operands)."""
        dt = self.key_weight.dtype
        prev = prev.to(dt)
        if which == "key":
            if self.key_down is None:
                return prev, self.key_weight, None, None
            return prev @ self.key_down.T, self.key_weight, None, None
        C = self.value_bias.shape[0]
        prev_v = prev_v.to(dt)
        if self.value_down is None:
            return prev, self.value_weight[:, :C], prev_v, self.value_weight[:, C:]
        return prev @ self.value_down[:, :C].T + prev_v @ self.value_down[:, C:].T, self.value_weight, None, None

    def bias(self, which: str) -> torch.Tensor:
        return self.key_bias if which == "key" else self.value_bias

    def predict(self, which: str, prev: torch.Tensor, prev_v: torch.Tensor | None = None) -> torch.Tensor:
        """The prediction [T, C], fp32 arithmetic on the op's operands in its order ((a w^T + a2 w2^T) + bias)."""
        a, w, a2, w2 = self.operands(which, prev, prev_v)
        out = a.float() @ w.float().T
        if a2 is not None:
            out = out + a2.float() @ w2.float().T
        return out + self.bias(which)

    def reconstruct(self, which, prev, codes, norms, grid, group_size, signs, prev_v=None) -> torch.Tensor:
        """prediction + deq(codes, norms) as one aqua_reconstruct call: fp32 [T, C]. The one function every
        reconstruction goes through (calibration, the cache's encode and decode paths)."""
        from . import ops

        a, w, a2, w2 = self.operands(which, prev, prev_v)
        return ops.aqua_reconstruct(a, w, self.bias(which), codes, norms, grid, group_size, signs, a2, w2)

    def to(self, device=None, dtype=None) -> LayerPredictors:
        def cast(t, d):
            return None if t is None else t.to(device=device, dtype=d).contiguous()

        w = dtype or self.key_weight.dtype
        return LayerPredictors(
            cast(self.key_weight, w),
            cast(self.key_bias, torch.float32),
            cast(self.value_weight, w),
            cast(self.value_bias, torch.float32),
            cast(self.key_down, w),
            cast(self.value_down, w),
        )


def reduce_rank(
    X: torch.Tensor, W: torch.Tensor, b: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank-r version (up [D_out, r], down [r, D_in], bias [D_out]) of the ridge fit x -> W x + b on inputs X [N, D_in]:
    reduced-rank regression on the fitted values. With mu = mean(X) and V the top-r eigenvectors of the centered
    predictions' scatter ((X - mu) W^T)^T ((X - mu) W^T), the rank-r map is mu_y + V V^T W (x - mu): up = V,
    down = V^T W, bias = b + (W - V V^T W) mu. Among rank-r maps it is the least-squares fit to the full fit's
    predictions on X (float64 inside, fp32 out)."""
    d_out, d_in = W.shape
    if not (is_int(rank) and 1 <= rank < min(d_out, d_in)):
        raise ValueError(f"reduce_rank: rank must be an int in [1, {min(d_out, d_in)}), got {rank!r}")
    Xd, Wd, bd = X.double(), W.double(), b.double()
    mu = Xd.mean(0)
    Yc = (Xd - mu) @ Wd.T
    _, vecs = torch.linalg.eigh(Yc.T @ Yc)  # ascending eigenvalues
    V = vecs[:, -rank:].flip(-1).contiguous()  # [D_out, r], largest first
    down = V.T @ Wd
    bias = bd + (Wd @ mu - V @ (down @ mu))
    return V.float().contiguous(), down.float().contiguous(), bias.float().contiguous()


@dataclass
class AquaPredictors:
    """Every layer's predictors of one model (layers[0] is None: layer 0 has none), the RoPE frequencies the
    calibration model used, and the file metadata: fingerprint {model, settings} and held-out statistics."""

    layers: list[LayerPredictors | None]
    inv_freq: torch.Tensor
    rope_scaling: float
    model: dict
    settings: dict
    stats: list[dict] = field(default_factory=list)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def channels(self) -> int:
        return self.layers[1].key_weight.shape[0] if self.num_layers > 1 else 0

    @property
    def backbone(self) -> Backbone:
        return Backbone(**self.settings["backbone"])

    def check_model(self, config, model=None) -> None:
        """Raise ValueError if a model config (and, given the model, its layer-0 k_proj weight) is not the one these
        predictors were calibrated on."""
        mismatched = []
        have = model_fingerprint(config)
        for key, want in self.model.items():
            if key == "k_proj_digest":
                if model is not None and want != _weight_digest(model):
                    mismatched.append("the layer-0 k_proj weight (another checkpoint of the same architecture)")
            elif have.get(key) != want:
                mismatched.append(f"{key}: calibrated for {want!r}, this model has {have.get(key)!r}")
        if mismatched:
            raise ValueError(
                "AQUA-KV predictors do not fit this model (recalibrate with `python -m kvkernels calibrate aqua "
                "--model DIR`): " + "; ".join(mismatched)
            )

    def save(self, path: Path | str) -> Path:
        from safetensors.torch import save_file

        tensors = {"rope.inv_freq": self.inv_freq.float().contiguous()}
        for l, p in enumerate(self.layers):
            if p is None:
                continue
            for name, t in (
                ("key.weight", p.key_weight),
                ("key.bias", p.key_bias),
                ("value.weight", p.value_weight),
                ("value.bias", p.value_bias),
                ("key.down", p.key_down),
                ("value.down", p.value_down),
            ):
                if t is not None:
                    tensors[f"layers.{l}.{name}"] = t.float().contiguous().cpu()
        low_rank = any(p is not None and p.rank is not None for p in self.layers)
        meta = {
            "format": SCHEMA_LOW_RANK if low_rank else SCHEMA,
            "num_layers": str(self.num_layers),
            "rope_scaling": repr(float(self.rope_scaling)),
            "model": json.dumps(self.model, sort_keys=True),
            "settings": json.dumps(self.settings, sort_keys=True),
            "stats": json.dumps(self.stats),
        }
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata=meta)
        return path


def load_predictors(path: Path | str, config=None, model=None, device="cpu") -> AquaPredictors:
    """Read a predictor file (AquaPredictors.save); with config (a model config) or model, check they match."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no AQUA-KV predictor file at {path} (make one: python -m kvkernels calibrate aqua)")
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        meta = f.metadata() or {}
        if meta.get("format") not in (SCHEMA, SCHEMA_LOW_RANK):
            raise ValueError(
                f"{path} is not an AQUA-KV predictor file ({SCHEMA} or {SCHEMA_LOW_RANK}), its format is "
                f"{meta.get('format')!r}"
            )
        n = int(meta["num_layers"])
        names = set(f.keys())
        layers: list[LayerPredictors | None] = [None]
        for l in range(1, n):
            full = [f.get_tensor(f"layers.{l}.{k}") for k in _TENSOR_NAMES]
            low = [f.get_tensor(f"layers.{l}.{k}") if f"layers.{l}.{k}" in names else None for k in _LOW_RANK_NAMES]
            layers.append(LayerPredictors(*full, *low))
        preds = AquaPredictors(
            layers=layers,
            inv_freq=f.get_tensor("rope.inv_freq"),
            rope_scaling=float(meta["rope_scaling"]),
            model=json.loads(meta["model"]),
            settings=json.loads(meta["settings"]),
            stats=json.loads(meta.get("stats", "[]")),
        )
    if model is not None:
        preds.check_model(model.config, model)
    elif config is not None:
        preds.check_model(config)
    return preds


_TENSOR_NAMES = ("key.weight", "key.bias", "value.weight", "value.bias")
_LOW_RANK_NAMES = ("key.down", "value.down")  # rank-r files only (mode (c))


def model_fingerprint(config, model=None) -> dict:
    """The config fields a predictor file is bound to (JSON values), + the layer-0 k_proj digest given the model."""
    out = {}
    for name in FINGERPRINT_FIELDS:
        val = getattr(config, name, None)
        out[name] = json.loads(json.dumps(val, sort_keys=True, default=str))
    if model is not None:
        out["k_proj_digest"] = _weight_digest(model)
    return out


def _weight_digest(model) -> str:
    w = _decoder_layers(model)[0].self_attn.k_proj.weight.detach().float().cpu().contiguous()
    return hashlib.sha256(w.numpy().tobytes()).hexdigest()[:16]


def _decoder_layers(model):
    inner = getattr(model, "model", model)
    return inner.layers


# ---------------------------------------------------------------------------------------------------------
# calibration text, disjoint from the evaluation's


class _Recording(Sequence):
    """A sequence that remembers which indices were read (to see which articles build_contexts consumes)."""

    def __init__(self, items: Sequence):
        self.items, self.read = items, set()

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        self.read.add(i)
        return self.items[i]


def eval_article_indices(
    articles: Sequence[str], encode: Callable[[str], list[int]], length: int, count: int, seed: int = 0
) -> set[int]:
    """The indices of the articles kvkernels.quality.build_contexts reads for `count` contexts of `length` tokens."""
    from .quality import build_contexts

    rec = _Recording(articles)
    build_contexts(rec, encode, length, count, seed=seed)
    return rec.read


def calibration_order(n_articles: int) -> list[int]:
    """Article indices in the order calibration reads them: the eval's seed-0 shuffle, from its back."""
    order = list(range(n_articles))
    random.Random(0).shuffle(order)  # the same shuffle as quality.build_contexts(seed=0)
    return order[::-1]


def calibration_windows(
    articles: Sequence[str], encode: Callable[[str], list[int]], seqlen: int, count: int
) -> tuple[list[torch.Tensor], list[int]]:
    """`count` windows of `seqlen` token ids (1-D int64) of articles in calibration_order, joined with the eval's
    separator (each window starts at an article), and the indices of the articles used."""
    from .quality import ARTICLE_SEPARATOR

    order = calibration_order(len(articles))
    windows, used, cursor = [], [], 0
    while len(windows) < count:
        stream: list[int] = []
        text = ""
        while len(stream) < seqlen:
            if cursor >= len(order):
                raise ValueError(f"the corpus ({len(articles)} articles) is too small for {count} x {seqlen} tokens")
            text = articles[order[cursor]] if not text else text + ARTICLE_SEPARATOR + articles[order[cursor]]
            used.append(order[cursor])
            cursor += 1
            stream = encode(text)
        windows.append(torch.tensor(stream[:seqlen], dtype=torch.long))
    return windows, used


# ---------------------------------------------------------------------------------------------------------
# capture and calibration


@torch.inference_mode()
def capture_kv(model, windows: Sequence[torch.Tensor], skip: int = 0, progress: bool = True):
    """Each layer's exact (keys, values) [N, C] fp32 from k_proj / v_proj outputs (pre-RoPE keys, all KV heads of a
    token concatenated as the projections lay them out), over the windows, dropping the first `skip` tokens of each
    (the attention sinks the cache keeps in fp16)."""
    from tqdm.auto import tqdm

    layers = _decoder_layers(model)
    got: list[tuple[list, list]] = [([], []) for _ in layers]
    hooks = []
    for l, layer in enumerate(layers):
        for which, proj in enumerate((layer.self_attn.k_proj, layer.self_attn.v_proj)):

            def hook(_mod, _inp, out, l=l, which=which):
                got[l][which].append(out[0, skip:].float().cpu())

            hooks.append(proj.register_forward_hook(hook))
    try:
        for ids in tqdm(windows, desc="capture K/V", unit="window", disable=not progress):
            model(ids[None].to(model.device), use_cache=False, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    return [(torch.cat(k), torch.cat(v)) for k, v in got]


@dataclass(frozen=True)
class CalibrationSettings:
    """What a calibration run did (recorded in the predictor file's fingerprint)."""

    tokens: int = 16384  # training tokens (before dropping the sinks)
    valid_tokens: int = 2048  # held-out tokens, for the statistics only
    seqlen: int = 2048
    reg: float = 1e-3
    skip_sinks: int = 4
    backbone: Backbone = Backbone()
    rank: int | None = None  # mode (c): rank-r predictors (reduce_rank of each ridge fit); None = full rank

    def __post_init__(self):
        if self.rank is not None and (not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1):
            raise ValueError(f"rank must be a positive int or None, got {self.rank!r}")


def _fit(X: torch.Tensor, Y: torch.Tensor, settings: CalibrationSettings):
    """The ridge fit of Y on X, reduced to rank settings.rank if set: (weight, bias, down or None)."""
    W, b = fit_ridge(X, Y, settings.reg)
    if settings.rank is None:
        return W, b, None
    up, down, b = reduce_rank(X, W, b, settings.rank)
    return up, b, down


def calibrate_on_kv(
    train: Sequence[tuple[torch.Tensor, torch.Tensor]],
    valid: Sequence[tuple[torch.Tensor, torch.Tensor]] | None,
    settings: CalibrationSettings = CalibrationSettings(),
    progress: bool = True,
) -> tuple[list[LayerPredictors | None], list[dict]]:
    """Algorithm 1 on captured K/V (per layer (keys, values) [N, C] fp32): the predictors and, per layer, held-out
    statistics (on `valid`, propagated through the same reconstructions): explained variance of each predictor,
    relMSE / equivalent bits of the reconstruction, and of the backbone alone at the same bits on the same tokens.
    With settings.rank, each predictor is the rank-r reduction of its ridge fit, and the layers above are fitted on
    the rank-r reconstructions (what inference will see)."""
    from tqdm.auto import tqdm

    from . import ops

    bb = settings.backbone
    preds: list[LayerPredictors | None] = []
    stats: list[dict] = []
    k_old = v_old = vk_old = vv_old = None
    for l in tqdm(range(len(train)), desc="calibrate AQUA-KV", unit="layer", disable=not progress):
        k, v = train[l]
        vk, vv = valid[l] if valid is not None else (None, None)
        if l == 0:  # no predictor: the first layer's own (4-bit) quantizer
            preds.append(None)
            grid, G, signs = bb.args(0, k.device)

            def direct(x, grid=grid, G=G, signs=signs):
                return None if x is None else ops.lattice_dequantize(*bb.quantize(x, 0), grid, G, signs)

            k_old, v_old, vk_old, vv_old = direct(k), direct(v), direct(vk), direct(vv)
            if vk is not None:
                stats.append(_layer_stats(0, vk, vv, vk_old, vv_old, None, None, vk_old, vv_old))
            continue
        wk, bk, dk = _fit(k_old, k, settings)
        keys_only = LayerPredictors(wk, bk, wk, bk, dk, dk)  # the value half is a placeholder until it is fitted
        k_rec = _encode(keys_only, "key", k_old, k, bb, l)
        wv, bv, dv = _fit(torch.cat([k_rec, v_old], dim=1), v, settings)  # keys first, as the reference
        p = LayerPredictors(wk, bk, wv, bv, dk, dv)
        v_rec = _encode(p, "value", k_rec, v, bb, l, v_old)
        preds.append(p)
        if vk is not None:
            pk = p.predict("key", vk_old)
            vk_rec = _encode(p, "key", vk_old, vk, bb, l)
            pv = p.predict("value", vk_rec, vv_old)
            vv_rec = _encode(p, "value", vk_rec, vv, bb, l, vv_old)
            grid, G, signs = bb.args(l, vk.device)
            plain_k = ops.lattice_dequantize(*bb.quantize(vk, l), grid, G, signs)
            plain_v = ops.lattice_dequantize(*bb.quantize(vv, l), grid, G, signs)
            stats.append(_layer_stats(l, vk, vv, vk_rec, vv_rec, pk, pv, plain_k, plain_v))
            vk_old, vv_old = vk_rec, vv_rec
        k_old, v_old = k_rec, v_rec
    return preds, stats


def _encode(p: LayerPredictors, which: str, prev, target, bb: Backbone, l: int, prev_v=None) -> torch.Tensor:
    """Alg. 2 for one tensor: quantize target - prediction, return the reconstruction (aqua_reconstruct)."""
    codes, norms = bb.quantize(target - p.predict(which, prev, prev_v), l)
    grid, G, signs = bb.args(l, prev.device)
    return p.reconstruct(which, prev, codes, norms, grid, G, signs, prev_v)


def _layer_stats(l, k, v, k_rec, v_rec, k_pred, v_pred, k_plain, v_plain) -> dict:
    out = {"layer": l}
    for name, x, rec, pred, plain in (("key", k, k_rec, k_pred, k_plain), ("value", v, v_rec, v_pred, v_plain)):
        out[f"{name}_ev"] = None if pred is None else explained_variance(pred, x)
        out[f"{name}_bits"] = equivalent_bits(rel_mse(rec, x))  # -log4 relMSE of the AQUA-KV reconstruction
        out[f"{name}_backbone_bits"] = equivalent_bits(rel_mse(plain, x))  # the backbone alone, same bits
    return out


def calibrate(
    model,
    tokenizer,
    articles: Sequence[str] | None = None,
    settings: CalibrationSettings = CalibrationSettings(),
    progress: bool = True,
    corpus_name: str = "",
) -> AquaPredictors:
    """Calibrate AQUA-KV predictors for `model` (a transformers Llama-like decoder) on text disjoint from the
    eval's (module docstring); returns them with per-layer held-out statistics."""
    from . import quality

    if articles is None:
        articles = quality.load_articles()
        corpus_name = corpus_name or f"{quality.CORPUS_PIP}:{quality.CORPUS_FILE}"

    C = model.config.num_key_value_heads * getattr(
        model.config, "head_dim", model.config.hidden_size // model.config.num_attention_heads
    )
    if settings.rank is not None and not settings.rank < C:
        raise ValueError(f"rank must be < C = H_kv * head_dim = {C} (a rank-C predictor is the full one), got "
                         f"{settings.rank}")  # fmt: skip
    encode = quality.text_encoder(tokenizer)
    n_train = -(-settings.tokens // settings.seqlen)
    n_valid = -(-settings.valid_tokens // settings.seqlen) if settings.valid_tokens else 0
    windows, used = calibration_windows(articles, encode, settings.seqlen, n_train + n_valid)
    eval_need = max(quality.FULL_PREFILL) + quality.FULL_DECODE + 1
    eval_used = eval_article_indices(articles, encode, eval_need, quality.FULL_CONTEXTS, seed=0)
    overlap = eval_used & set(used)
    if overlap:
        raise ValueError(
            f"calibration text would overlap the default eval's ({len(overlap)} shared articles): the corpus "
            f"({len(articles)} articles) is too small for {len(windows)} x {settings.seqlen} calibration tokens"
        )
    kv = capture_kv(model, windows, skip=settings.skip_sinks, progress=progress)
    per_window = settings.seqlen - settings.skip_sinks
    split = n_train * per_window
    train = [(k[:split], v[:split]) for k, v in kv]
    valid = [(k[split:], v[split:]) for k, v in kv] if n_valid else None
    layers, stats = calibrate_on_kv(train, valid, settings, progress=progress)
    rotary = model.model.rotary_emb
    s = asdict(settings)
    s.update(
        corpus=corpus_name, articles=len(used), eval_articles_excluded=len(eval_used), order="seed-0 shuffle, back"
    )
    return AquaPredictors(
        layers=layers,
        inv_freq=rotary.inv_freq.detach().float().cpu(),
        rope_scaling=float(getattr(rotary, "attention_scaling", 1.0)),
        model=model_fingerprint(model.config, model),
        settings=s,
        stats=stats,
    )


def format_stats(stats: Sequence[dict]) -> str:
    """The per-layer held-out table: explained variance of each predictor, equivalent bits (-log4 relMSE) of the
    AQUA-KV reconstruction and of the backbone alone at the same bits."""

    def f(x, spec):
        return "-" if x is None else format(x, spec)

    lines = ["layer  K EV   V EV   K bits (backbone)  V bits (backbone)"]
    for s in stats:
        lines.append(
            f"{s['layer']:5d}  {f(s['key_ev'], '.3f'):5s}  {f(s['value_ev'], '.3f'):5s}  "
            f"{s['key_bits']:6.2f} ({s['key_backbone_bits']:5.2f})     "
            f"{s['value_bits']:6.2f} ({s['value_backbone_bits']:5.2f})"
        )
    rest = [s for s in stats if s["key_ev"] is not None]
    if rest:

        def mean(key):
            return sum(s[key] for s in rest) / len(rest)

        lines.append(
            f"mean layers 1..{rest[-1]['layer']}: K EV {mean('key_ev'):.3f}, V EV {mean('value_ev'):.3f}; "
            f"K bits {mean('key_bits'):.2f} vs backbone {mean('key_backbone_bits'):.2f}, "
            f"V bits {mean('value_bits'):.2f} vs backbone {mean('value_backbone_bits'):.2f}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# `python -m kvkernels calibrate aqua`


def default_predictor_path(model_dir: Path, rank: int | None = None) -> Path:
    """build/aqua/<model folder name>[-r<rank>].safetensors (relative to the working directory, as the eval's
    build/eval)."""
    suffix = "" if rank is None else f"-r{rank}"
    return Path("build/aqua") / f"{Path(model_dir).name}{suffix}.safetensors"


def build_parser() -> argparse.ArgumentParser:
    d = CalibrationSettings()
    p = argparse.ArgumentParser(
        prog="python -m kvkernels calibrate aqua",
        description="Fit AQUA-KV's cross-layer predictors (ridge, Alg. 1) on a trained model, on text disjoint from "
        "the eval's; writes a safetensors file bound to the model (kvkernels/aqua.py).",
    )
    p.add_argument("--model", type=Path, help="converted model folder (default $KVKERNELS_CACHE_DIR/smollm2-135m)")
    p.add_argument("--tokens", type=int, default=d.tokens, help=f"calibration tokens (default {d.tokens})")
    p.add_argument("--valid-tokens", type=int, default=d.valid_tokens, help="held-out tokens for the statistics")
    p.add_argument("--seqlen", type=int, default=d.seqlen, help=f"tokens per forward window (default {d.seqlen})")
    p.add_argument("--bits", type=int, default=d.backbone.bits, choices=(2, 3, 4), help="backbone bits, layers >= 1")
    p.add_argument(
        "--rank",
        type=int,
        help="mode (c): rank-r predictors, r < C = H_kv * head_dim; FLOPs per token fall by C / 2r (keys) and "
        "2C / 3r (values), so only r < C / 2 saves on both",
    )
    p.add_argument("--reg", type=float, default=d.reg, help=f"ridge damping rate (default {d.reg:g})")
    p.add_argument(
        "--out", type=Path, help="predictor file (default build/aqua/<model folder name>[-r<rank>].safetensors)"
    )
    p.add_argument("--threads", type=int, help="torch intra-op threads")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "aqua":
        print("usage: python -m kvkernels calibrate aqua [--model DIR] [--tokens N] [--out FILE]", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv[1:])
    if args.threads:
        torch.set_num_threads(args.threads)
    from . import quality

    t0 = time.perf_counter()
    model_dir = args.model.expanduser() if args.model else quality.default_model_dir()
    try:
        model, tokenizer = quality.load_model(model_dir, progress=not args.no_progress)
    except quality.MissingDependencyError as e:
        print(f"kvkernels calibrate: {e}", file=sys.stderr)
        return 2
    settings = CalibrationSettings(
        tokens=args.tokens,
        valid_tokens=args.valid_tokens,
        seqlen=args.seqlen,
        reg=args.reg,
        backbone=Backbone(bits=args.bits),
        rank=args.rank,
    )
    preds = calibrate(model, tokenizer, settings=settings, progress=not args.no_progress)
    out = preds.save(args.out or default_predictor_path(model_dir, args.rank))
    print(format_stats(preds.stats))
    print(
        f"wrote {out} ({preds.settings['articles']} calibration articles, disjoint from the "
        f"{preds.settings['eval_articles_excluded']} the default eval reads) in {time.perf_counter() - t0:.1f} s"
    )
    return 0
