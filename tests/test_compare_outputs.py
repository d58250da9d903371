"""`llama-bridge compare`'s sections that run the models (llama_twins.compare): the outputs on
real text judged against the pair's storage type, where two models part, and the command's
report and exit codes.

SmolLM2's Q4_1 file against its float32 export and a Q8_0 re-export: same within quantisation;
its export with rope_theta changed: different, parting at block 0's attention. A small random
model: an adapter against its merge is the same; a broken row in one layer's w2 is found in that
layer's feed-forward."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import jax_llama
from bridge.chat import find_template
from bridge.compare.report import DIFFERENT, SAME, SKIPPED, WITHIN
from bridge.convert import convert
from bridge.formats import open_checkpoint
from bridge.formats.native import write_native
from bridge.lora import Adapter, LoraConfig, adapter_shapes, write_peft
from bridge.tokenizer import load_tokenizer
from llama_twins.cli.bridge_main import main
from llama_twins.compare import compare, default_text, end_line
from llama_twins.compare.blocks import where_they_part
from llama_twins.compare.outputs import compare_outputs, judge, windows

from conftest import small_config

# One window of about 250 tokens of the default text, its second half scored.
TEXT = default_text()[:1200]


@pytest.fixture(scope="module")
def smol(tmp_path_factory, smollm2) -> dict[str, Path]:
    """SmolLM2's Q4_1 file, its float32 HF export, a Q8_0 re-export of that, and the export with
    rope_theta changed in config.json (its weights hard-linked, not copied)."""
    root = tmp_path_factory.mktemp("compare-smol")
    hf = convert(smollm2, root / "hf32", "hf", dtype="float32", progress=False)
    q8 = convert(hf, root / "q8.gguf", "gguf", dtype="q8_0", progress=False)
    rope = root / "rope"
    rope.mkdir()
    for file in Path(hf).iterdir():
        (os.link if file.suffix == ".safetensors" else shutil.copy)(file, rope / file.name)
    config = json.loads((rope / "config.json").read_text())
    config["rope_theta"] = config["rope_theta"] / 10
    (rope / "config.json").write_text(json.dumps(config))
    return {"q4_1": Path(smollm2), "hf32": Path(hf), "q8": Path(q8), "rope": rope}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2) -> dict[str, Path]:
    """A random 3-layer model with SmolLM2's vocabulary (native), a random LoRA adapter of it
    and its merge, a copy with row 5 of layers.1.feed_forward.w2.weight broken, and one with
    its output head one row off."""
    root = tmp_path_factory.mktemp("compare-tiny")
    config = small_config(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=128,
                          vocab_size=49152, max_seq_len=1024, bos_id=1, eos_ids=(2,))
    native = root / "native"
    jax_llama.save(native, config, jax_llama.init(config, seed=0)[1])
    tokenizer = load_tokenizer(smollm2)
    tokenizer.save(native)
    find_template(smollm2, tokenizer).save(native)
    lora = LoraConfig(rank=4, alpha=8)
    rng = np.random.default_rng(0)
    adapter = write_peft(root / "adapter", config, Adapter(lora, {
        name: rng.normal(0, 0.05, shape).astype(np.float32)
        for name, shape in adapter_shapes(config, lora).items()}))
    merged = root / "merged"
    assert main(["merge-lora", str(native), str(adapter), str(merged), "--no-progress"]) == 0
    ckpt = open_checkpoint(native)
    broken_name = "layers.1.feed_forward.w2.weight"

    def fetch(name):
        t = ckpt.tensor(name)
        if name == broken_name:
            t[5] = 3.0
        return t
    broken = write_native(root / "broken", config, ckpt.specs, fetch, extra_files=ckpt.extra_files)

    def one_row_off(name):  # the head written one row off (llama.cpp #12567)
        t = ckpt.tensor(name)
        return np.roll(t, 1, axis=0) if name == "output.weight" else t
    head = write_native(root / "head", config, ckpt.specs, one_row_off,
                        extra_files=ckpt.extra_files)
    return {"native": native, "adapter": Path(adapter), "merged": merged, "broken": Path(broken),
            "head": Path(head)}


def test_windows_are_llama_perplexitys():
    ids = list(range(10, 1300))
    cut = windows(ids, bos=1, size=512)
    assert [len(w) for w in cut] == [512, 512]  # whole windows only, the rest left out
    assert cut[0][0] == cut[1][0] == 1 and cut[1][1] == 10 + 511
    assert [len(w) for w in windows(ids[:100], bos=None)] == [100]  # shorter: one window


def test_judge_thresholds():
    base = dict(tokens=256, windows=1, p99_kl=0.0, max_kl=0.0, same_top1=100.0, ppl_a=9.0,
                ppl_b=9.0)
    assert judge(dict(base, mean_kl=1e-8, max_kl=1e-7), "float32", "float32").verdict == SAME
    assert judge(dict(base, mean_kl=1e-3), "float32", "float32").verdict == DIFFERENT
    within = judge(dict(base, mean_kl=0.1), "float32", "Q4_0")
    assert within.verdict == WITHIN and within.figures["reference"]["mean_kl"] == 0.071940
    assert judge(dict(base, mean_kl=0.5), "float32", "Q4_0").verdict == DIFFERENT
    assert judge(dict(base, mean_kl=0.001, same_top1=80.0), "F32", "Q8_0").verdict == DIFFERENT


def test_outputs_are_skipped_without_a_tokenizer_or_with_another_vocabulary(tiny, tmp_path):
    ckpt = open_checkpoint(tiny["native"])
    bare = write_native(tmp_path / "bare", ckpt.config, ckpt.specs, ckpt.tensor)  # no tokenizer
    f = compare_outputs(open_checkpoint(bare), ckpt, TEXT)
    assert f.verdict == SKIPPED and "cannot be tokenised" in f.summary
    config = small_config(vocab_size=97)
    other = tmp_path / "other"
    jax_llama.save(other, config, jax_llama.init(config, seed=0)[1])
    f = compare_outputs(ckpt, open_checkpoint(other), TEXT)
    assert f.verdict == SKIPPED and "49152 in A, 97 in B" in f.summary


def test_q4_1_as_stored_against_its_float32_export_is_within_quantisation(smol):
    """The export holds the Q4_1 file's own values, dequantised: what is left is the 4-bit
    kernels' arithmetic against float32's, far below Q4_1's own cost."""
    f = compare_outputs(open_checkpoint(smol["q4_1"]), open_checkpoint(smol["hf32"]), TEXT)
    assert f.verdict == WITHIN, f.lines
    assert f.figures["windows"] == 1 and f.figures["mean_kl"] < 0.01
    assert f.figures["same_top1"] > 95 and abs(f.figures["ppl_a"] / f.figures["ppl_b"] - 1) < 0.02


@pytest.mark.slow  # 40 s on 2 cores: the Q4_1 test above runs the same path
def test_q8_0_re_export_is_within_quantisation(smol):
    f = compare_outputs(open_checkpoint(smol["hf32"]), open_checkpoint(smol["q8"]), TEXT)
    assert f.verdict == WITHIN, f.lines
    assert f.figures["reference"]["type"] == "Q8_0" and 1e-4 < f.figures["mean_kl"] < 0.02


@pytest.mark.slow
def test_llama_cpps_q4_k_m_is_within_quantisation(smol, tmp_path):
    """llama.cpp's own quantiser: SmolLM2's 576-wide rows fall back to Q5_0 and Q8_0 beside its
    Q4_K and Q6_K tensors; the pair is judged by Q4_K's figure, the coarsest it holds."""
    pytest.importorskip("llama_cpp")
    q4km = convert(smol["hf32"], tmp_path / "q4_k_m.gguf", "gguf", dtype="q4_k_m", progress=False)
    f = compare_outputs(open_checkpoint(smol["hf32"]), open_checkpoint(q4km), TEXT)
    assert f.verdict == WITHIN and f.figures["reference"]["type"] == "Q4_K", f.lines


def test_changed_rope_theta_differs_and_parts_at_block_0s_attention(smol):
    a, b = open_checkpoint(smol["hf32"]), open_checkpoint(smol["rope"])
    f = compare_outputs(a, b, TEXT)
    assert f.verdict == DIFFERENT and f.figures["mean_kl"] > 0.01, f.lines
    ids = load_tokenizer(smol["hf32"]).encode(TEXT[:600])
    part = where_they_part(a, b, ids)
    assert part.verdict == DIFFERENT
    assert (part.figures["block"], part.figures["sublayer"]) == (0, "attention")
    assert "rope_theta" in part.check_next


def test_an_adapter_is_the_same_as_its_merge(tiny):
    f = compare_outputs(open_checkpoint(tiny["native"]), open_checkpoint(tiny["merged"]), TEXT,
                        adapter=tiny["adapter"])
    assert f.verdict == SAME, f.lines
    # and the adapter changes the model: without it, A is not its merge
    g = compare_outputs(open_checkpoint(tiny["native"]), open_checkpoint(tiny["merged"]), TEXT)
    assert g.verdict == DIFFERENT and g.figures["mean_kl"] > 1e-4


def test_compare_an_adapter_with_its_merge_is_the_same_in_every_section(tiny):
    """The read sections see A with the adapter merged (the weights included), not A alone."""
    result, findings = compare(str(tiny["native"]), str(tiny["merged"]),
                               adapter=str(tiny["adapter"]), text=TEXT)
    assert result == SAME, [(f.section, f.verdict, f.summary) for f in findings]
    result, findings = compare(str(tiny["native"]), str(tiny["merged"]), text=TEXT)
    assert result == DIFFERENT


def test_a_merge_with_another_lora_scale_is_named_with_its_scale(tiny, tmp_path):
    """A merge that scaled the adapter's update by alpha / r with another alpha (unsloth
    #2142's class): the weights name the factor; the merge with the adapter's own scale is the
    same (the test above)."""
    from bridge.lora import read_peft
    config = open_checkpoint(tiny["native"]).config
    adapter = read_peft(tiny["adapter"], config)
    doubled = write_peft(tmp_path / "doubled", config, Adapter(
        dataclasses.replace(adapter.lora, alpha=2 * adapter.lora.alpha), adapter.tensors))
    merged = tmp_path / "merged"
    assert main(["merge-lora", str(tiny["native"]), str(doubled), str(merged),
                 "--no-progress"]) == 0
    result, findings = compare(str(tiny["native"]), str(merged), adapter=str(tiny["adapter"]),
                               text=TEXT[:400])
    weights = next(f for f in findings if f.section == "weights")
    assert result == DIFFERENT and "plus 2 x the adapter's update" in weights.cause, weights.cause
    assert "lora_alpha" in weights.check_next
    # the base model handed back as the "merge": not merged is named as such
    result, findings = compare(str(tiny["native"]), str(tiny["native"]),
                               adapter=str(tiny["adapter"]), text=TEXT[:400])
    weights = next(f for f in findings if f.section == "weights")
    assert "without the adapter's update (not merged)" in weights.cause, weights.cause


def test_a_broken_row_is_found_in_its_layers_feed_forward(tiny):
    a, b = open_checkpoint(tiny["native"]), open_checkpoint(tiny["broken"])
    assert compare_outputs(a, b, TEXT).verdict == DIFFERENT
    part = where_they_part(a, b, load_tokenizer(tiny["native"]).encode(TEXT[:600]))
    assert (part.figures["block"], part.figures["sublayer"]) == (1, "feed_forward")
    assert "layers.1.feed_forward.w2.weight" in part.check_next
    assert part.figures["blocks"][0]["feed_forward"] == 0  # block 0 untouched, fed A's input


def test_a_head_one_row_off_is_found_at_the_head(tiny):
    part = where_they_part(open_checkpoint(tiny["native"]), open_checkpoint(tiny["head"]),
                           load_tokenizer(tiny["native"]).encode(TEXT))
    assert part.verdict == DIFFERENT and part.figures["sublayer"] == "head", part.lines
    assert all(v == 0 for block in part.figures["blocks"] for v in block.values())


def _halves(t: np.ndarray, heads: int) -> np.ndarray:
    """q/k rows of each head from the interleaved RoPE layout into halves: the other
    convention, what a converter that permutes twice (or never) leaves."""
    d = t.shape[0] // heads
    return t.reshape(heads, d // 2, 2, -1).transpose(0, 2, 1, 3).reshape(t.shape)


@pytest.mark.parametrize("bug, part, advice", [
    ("norm_eps", ("attention_norm", "ffn_norm"), "norm_eps"),
    ("qk_layout", ("attention",), "RoPE layout")])
def test_a_cause_every_block_shares_is_named_where_it_acts(tiny, tmp_path, bug, part, advice):
    """Norm epsilon written with a library's default; q/k rows left in the other RoPE layout on
    a grouped-query model (4 heads, 2 kv heads): every block parts alike, first in block 0."""
    ckpt = open_checkpoint(tiny["native"])
    config, fetch = ckpt.config, ckpt.tensor
    if bug == "norm_eps":
        config = dataclasses.replace(config, norm_eps=1e-6)
    else:
        def fetch(name):
            t = ckpt.tensor(name)
            heads = {"wq": config.n_heads, "wk": config.n_kv_heads}.get(name.split(".")[-2])
            return t if heads is None else _halves(t, heads)
    b = write_native(tmp_path / bug, config, ckpt.specs, fetch, extra_files=ckpt.extra_files)
    found = where_they_part(ckpt, open_checkpoint(b), load_tokenizer(tiny["native"]).encode(TEXT))
    assert found.verdict == DIFFERENT and found.figures["block"] == 0, found.lines
    assert found.figures["sublayer"] in part and advice in found.check_next


def test_compare_runs_the_blocks_only_when_outputs_differ(tiny):
    result, findings = compare(str(tiny["native"]), str(tiny["broken"]), text=TEXT)
    assert result == DIFFERENT and [f.section for f in findings][-2:] == ["outputs", "blocks"]
    assert findings[-1].figures["block"] == 1 and findings[-1].figures["sublayer"] == "feed_forward"
    # the first cause found is named: the weights section's broken row where it is built
    assert "layers.1.feed_forward" in end_line(result, findings)
    result, findings = compare(str(tiny["native"]), str(tiny["native"]), text=TEXT)
    assert result == SAME and findings[-1].section == "outputs"


def test_cli_exit_codes(tiny, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    assert main(["compare", str(tiny["native"]), str(tiny["native"]), "--text", str(text),
                 "--no-progress"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "same"
    assert main(["compare", str(tiny["native"]), str(tiny["broken"]), "--text", str(text),
                 "--json", "--no-progress"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == DIFFERENT and report["sections"][-1]["section"] == "blocks"
    assert report["sections"][-1]["figures"]["block"] == 1
    assert main(["compare", str(tmp_path / "missing"), str(tiny["native"])]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "missing" in err
    assert main(["compare", str(tiny["native"]), str(tiny["native"]), "--text",
                 str(tmp_path / "none.txt")]) == 2
    assert "none.txt" in capsys.readouterr().err
