"""Direct torch.ops calls with bad arguments raise an error naming the argument, on every registration: the C++ CPU
kernels (csrc/op_checks.h, shared with the CUDA bindings), the Python kernels and the fakes (kvkernels/_validate.py).
Regression tests for the defects found by fuzzing (the robustness issue, items 1-4): each of these used to crash the
process (SIGFPE / SIGSEGV), read out of bounds, or return garbage."""

import pytest
import torch
from conftest import requires_c

import kvkernels

ops = torch.ops.kvkernels


def _quantized(mode="asym"):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    return x, *kvkernels.quantize_groups(x, 3, 32, mode)


def _half(*shape):
    return torch.zeros(*shape, dtype=torch.float16)


# (name, call, exception, message fragment); x: [4, 64] fp32, c/s/z: its 3-bit codes [4, 6], scales/zeros [4, 2]
CPU_CASES = [
    # 1. dequantize_groups on CPU
    (
        "deq group 16 on codes of 32",
        lambda x, c, s, z: ops.dequantize_groups(c, s, z, 3, 16, "asym"),
        ValueError,
        "group_size",
    ),
    (
        "deq group 0 (was SIGFPE)",
        lambda x, c, s, z: ops.dequantize_groups(c, s, z, 3, 0, "asym"),
        ValueError,
        "group_size",
    ),
    ("deq negative group", lambda x, c, s, z: ops.dequantize_groups(c, s, z, 3, -32, "asym"), ValueError, "group_size"),
    ("deq group 48", lambda x, c, s, z: ops.dequantize_groups(c, s, z, 3, 48, "asym"), ValueError, "group_size"),
    (
        "deq empty scales (was SIGSEGV)",
        lambda x, c, s, z: ops.dequantize_groups(c, _half(0), z, 3, 32, "asym"),
        ValueError,
        "scales must have shape",
    ),
    (
        "deq one scale for all",
        lambda x, c, s, z: ops.dequantize_groups(c, s[:1, :1], z, 3, 32, "asym"),
        ValueError,
        "scales must have shape",
    ),
    (
        "deq short zeros",
        lambda x, c, s, z: ops.dequantize_groups(c, s, z[:2], 3, 32, "asym"),
        ValueError,
        "zeros must have shape",
    ),
    (
        "deq words not a multiple of bits",
        lambda x, c, s, z: ops.dequantize_groups(c[:, :5], s, z, 3, 32, "asym"),
        ValueError,
        "multiple of bits",
    ),
    ("deq fp32 scales", lambda x, c, s, z: ops.dequantize_groups(c, s.float(), z, 3, 32, "asym"), TypeError, "scales"),
    (
        "deq asym without zeros",
        lambda x, c, s, z: ops.dequantize_groups(c, s, None, 3, 32, "asym"),
        ValueError,
        "zeros is required",
    ),
    # 2. quantize_groups / quantize_groups_into on CPU
    ("quant int x", lambda x, c, s, z: ops.quantize_groups(x.int(), 3, 32, "sym", 0.0), TypeError, "x must be"),
    ("quant bool x", lambda x, c, s, z: ops.quantize_groups(x > 0, 3, 32, "sym", 0.0), TypeError, "x must be"),
    ("quant float64 x", lambda x, c, s, z: ops.quantize_groups(x.double(), 3, 32, "sym", 0.0), TypeError, "x must be"),
    (
        "quant complex x",
        lambda x, c, s, z: ops.quantize_groups(x.to(torch.complex64), 3, 32, "sym", 0.0),
        TypeError,
        "x must be",
    ),
    ("quant eta -1", lambda x, c, s, z: ops.quantize_groups(x, 3, 32, "asym", -1.0), ValueError, "eta"),
    ("quant eta 0.7", lambda x, c, s, z: ops.quantize_groups(x, 3, 32, "asym", 0.7), ValueError, "eta"),
    ("quant eta nan", lambda x, c, s, z: ops.quantize_groups(x, 3, 32, "asym", float("nan")), ValueError, "eta"),
    ("quant eta with sym", lambda x, c, s, z: ops.quantize_groups(x, 3, 32, "sym", 0.25), ValueError, "asym mode only"),
    ("quant bits 5", lambda x, c, s, z: ops.quantize_groups(x, 5, 32, "sym", 0.0), ValueError, "bits"),
    (
        "into broadcast codes",
        lambda x, c, s, z: ops.quantize_groups_into(x, 3, 32, "asym", 0.0, c[:1], s, z),
        ValueError,
        "codes must have shape",
    ),
    (
        "into float codes",
        lambda x, c, s, z: ops.quantize_groups_into(x, 3, 32, "asym", 0.0, c.float(), s, z),
        TypeError,
        "codes",
    ),
    (
        "into strided scales",
        lambda x, c, s, z: ops.quantize_groups_into(x, 3, 32, "asym", 0.0, c, _half(2, 4).t(), z),
        ValueError,
        "stride 1",
    ),
    (
        "into meta output",
        lambda x, c, s, z: ops.quantize_groups_into(x, 3, 32, "asym", 0.0, c.to("meta"), s, z),
        ValueError,
        "one device",
    ),
    (
        "into meta x",
        lambda x, c, s, z: ops.quantize_groups_into(x.to("meta"), 3, 32, "asym", 0.0, c, s, z),
        ValueError,
        "one device",
    ),
    ("pack float codes", lambda x, c, s, z: ops.pack_bits(x, 3), TypeError, "integer"),
    ("unpack bits 0", lambda x, c, s, z: ops.unpack_bits(c, 0), ValueError, "bits"),
]


@requires_c
@pytest.mark.parametrize("name, call, exc, match", CPU_CASES, ids=[c[0] for c in CPU_CASES])
def test_direct_cpu_op_rejects_bad_arguments(name, call, exc, match):
    x, c, s, z = _quantized()
    with pytest.raises(exc, match=match):
        call(x, c, s, z)


@requires_c
def test_direct_cpu_ops_still_compute_the_reference():
    # the checks must not reject valid calls, including strided rows (last dim contiguous)
    x, c, s, z = _quantized()
    torch.testing.assert_close(
        ops.dequantize_groups(c, s, z, 3, 32, "asym"), kvkernels.reference.dequantize_groups(c, s, z, 3, 32, "asym")
    )
    big = torch.randn(4, 128)
    codes, scales, zeros = torch.empty(4, 12, dtype=torch.int32), _half(4, 4), _half(4, 4)
    ops.quantize_groups_into(big[:, :64], 3, 32, "asym", 0.1, codes[:, :6], scales[:, :2], zeros[:, :2])
    want = kvkernels.reference.quantize_groups(big[:, :64].contiguous(), 3, 32, "asym", 0.1)
    for got, w in zip((codes[:, :6], scales[:, :2], zeros[:, :2]), want, strict=True):
        torch.testing.assert_close(got, w, rtol=0, atol=0)


META_CASES = [
    # 3. the fakes validate what they can (metadata)
    (
        "dequantize bits 9",
        lambda m: ops.dequantize_groups(m(4, 6, dtype=torch.int32), m(4, 2, dtype=torch.half), None, 9, 32, "sym"),
        ValueError,
        "bits",
    ),
    (
        "unpack bits 0 (was ZeroDivisionError)",
        lambda m: ops.unpack_bits(m(4, 6, dtype=torch.int32), 0),
        ValueError,
        "bits",
    ),
    ("quantize group 48", lambda m: ops.quantize_groups(m(4, 96), 3, 48, "sym", 0.0), ValueError, "group_size"),
    (
        "gemv H_q not a multiple of H_kv",
        lambda m: ops.gemv_inner_q(
            m(1, 3, 1, 64), m(1, 2, 8, 6, dtype=torch.int32), m(1, 2, 8, 2, dtype=torch.half), None, 3, 32, "sym"
        ),
        ValueError,
        "multiple of KV heads",
    ),
    (
        "kivi wrong rows",
        lambda m: ops.gemv_kivi(
            m(1, 2, 64),
            m(1, 1, 32, 2, dtype=torch.int32),
            m(1, 1, 32, 1, dtype=torch.half),
            m(1, 1, 32, 1, dtype=torch.half),
            2,
            32,
        ),
        ValueError,
        "rows",
    ),
    (
        "pack int32 ok but last dim 33",
        lambda m: ops.pack_bits(m(4, 33, dtype=torch.int32), 3),
        ValueError,
        "multiple of 32",
    ),
]


@requires_c
@pytest.mark.parametrize("name, call, exc, match", META_CASES, ids=[c[0] for c in META_CASES])
def test_fake_kernels_validate(name, call, exc, match):
    def meta(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device="meta")

    with pytest.raises(exc, match=match):
        call(meta)


def test_public_dequantize_rejects_mixed_devices():
    # 4. CPU codes with meta scales used to return garbage
    _, c, s, z = _quantized()
    with pytest.raises(ValueError, match="one device"):
        kvkernels.dequantize_groups(c, s.to("meta"), z, 3, 32, "asym")
