"""The KIVI format (kvkernels/formats/kivi.py): config validation, effective bits, the asym-only GEMV contract."""

import pytest
import torch

from kvkernels import reference
from kvkernels.formats import PRESETS, KIVIConfig, effective_bits, get_format

KIVI = get_format("kivi")


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: KIVIConfig(bits=8), "bits"),
        (lambda: KIVIConfig(eta=0.5), "eta"),
        (lambda: KIVIConfig(eta=-0.1), "eta"),
        (lambda: KIVIConfig(residual=-1), "residual"),
        (lambda: KIVIConfig(group_size=16), "group_size"),
        (lambda: KIVIConfig(w_sink=-2), "w_sink"),
    ],
)
def test_config_validation(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_effective_bits_of_presets():
    want = {"kivi2": (3.0, 3.0, 3.0), "kivi4": (5.0, 5.0, 5.0), "kivi1_eta": (2.0, 2.0, 2.0)}
    assert set(want) == set(KIVI.presets)
    for name, (k, v, avg) in want.items():
        e = effective_bits(PRESETS[name])
        assert (e.key, e.value, e.average) == (k, v, avg), name
    # keys leave the residual window in whole groups of G tokens, values one at a time
    e = effective_bits(KIVIConfig(bits=2, residual=128, w_sink=32))
    assert (e.fp16_key_tokens, e.fp16_value_tokens) == (32 + 128 + 31, 32 + 128)


def test_uniform_view_of_the_config():
    c = KIVIConfig(bits=4, residual=64, eta=0.25)
    assert (c.key_bits, c.value_bits, c.key_mode, c.value_mode, c.w_recent) == (4, 4, "asym", "asym", 64)
    assert c.eta_for("asym") == 0.25


def test_gemv_contract_is_asym_without_x_scale():
    x = torch.randn(1, 2, 64)
    codes = torch.zeros(1, 1, 64, 2, dtype=torch.int32)
    scales = torch.ones(1, 1, 64, 1, dtype=torch.float16)
    zeros = torch.zeros_like(scales)
    out = KIVI.gemv(reference.gemv_kivi, x, codes, scales, zeros, 2, 32, "asym")
    assert out.shape == (1, 2, 32)
    with pytest.raises(ValueError, match="asym without x_scale"):
        KIVI.gemv(reference.gemv_kivi, x, codes, scales, zeros, 2, 32, "sym")
    with pytest.raises(ValueError, match="asym without x_scale"):
        KIVI.gemv(reference.gemv_kivi, x, codes, scales, zeros, 2, 32, "asym", x_scale=torch.ones(1, 64))
