"""The decode benchmark's real-weight rows on SmolLM2 (slow: each row is a worker process that
loads the 135M model): llama.cpp on the GGUF file itself, and JAX streaming through the CLI's
Streamer. Figures are this machine's and not asserted; their form is."""

import pytest

pytestmark = pytest.mark.slow


def spec_for(smollm2, tmp_path, **fields):
    from bridge.convert import convert
    from bridge.formats import open_checkpoint
    from llama_twins.bench.common import Spec

    native = tmp_path / "native"
    if not native.exists():
        convert(smollm2, native, to="native", dtype="float32", progress=False)
    return Spec(config=open_checkpoint(native).config, weights=str(native), warmup=0, repeats=1,
                decode_batches=(1,), new_tokens=8, **fields)


def test_llama_cpp_row_on_the_gguf(smollm2, tmp_path):
    pytest.importorskip("llama_cpp")
    from llama_twins.bench.common import spawn
    times = spawn("llama.cpp", spec_for(smollm2, tmp_path, gguf=str(smollm2)), ("decode",))
    assert set(times["decode"]) == {"1/1", "1/8"}
    assert times["decode"]["1/8"][0] > times["decode"]["1/1"][0] > 0


def test_streamed_row_decodes_through_the_streamer(smollm2, tmp_path):
    from llama_twins.bench.common import spawn
    times = spawn("jax-llama", spec_for(smollm2, tmp_path, stream=True), ("decode",))
    assert set(times["decode"]) == {"1/1", "1/8"}
    assert times["decode"]["1/8"][0] > times["decode"]["1/1"][0] > 0
