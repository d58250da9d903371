"""The round-trip demo behind `llama-bridge demo`: one fresh model, both twins, one checkpoint
format. jax and torch are imported inside `run`, so that `llama-bridge` starts fast."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from bridge.config import LlamaConfig
from bridge.errors import BridgeError
from bridge.tensors import count_params

# float32 through the same weights: the twins differ only by the order of float32 roundings
# (matmul blocking, softmax), about 1e-7 relative per op, so 1e-5 of the logit scale is generous
# for small models while a single wrong weight, axis or RoPE pair moves logits by far more.
RELATIVE_TOLERANCE = 1e-5


def run(config: LlamaConfig, out: Path, batch: int, seq_len: int, seed: int) -> int:
    """Returns the exit code: 0 when both directions agree within tolerance, 1 otherwise."""
    for name, value in (("batch", batch), ("seq_len", seq_len)):
        if value <= 0:
            raise BridgeError(f"must be positive (got {value})", field=name)
    if seq_len > config.max_seq_len:
        raise BridgeError(f"{seq_len} exceeds the config's max_seq_len {config.max_seq_len}",
                          field="seq_len")
    import jax_llama
    import torch
    import torch_llama

    say = lambda *a: print(*a, file=sys.stderr)  # noqa: E731 - progress to stderr
    tokens = np.random.default_rng(seed).integers(0, config.vocab_size, (batch, seq_len), dtype=np.int32)
    say(f"init a {count_params(config):,}-parameter model in JAX (seed {seed})")
    model, params = jax_llama.init(config, seed=seed)
    jax_logits = np.asarray(model.apply({"params": params}, tokens))

    say(f"save it as a native checkpoint in {out / 'from_jax'}, load it in torch (cpu)")
    jax_llama.save(out / "from_jax", config, params)
    tmodel = torch_llama.load(out / "from_jax", device="cpu")
    with torch.inference_mode():
        torch_logits = tmodel(torch.from_numpy(tokens)).numpy()

    say(f"save the torch model to {out / 'from_torch'}, load it back in JAX")
    torch_llama.save(out / "from_torch", tmodel)
    model2, params2 = jax_llama.load(out / "from_torch")
    back_logits = np.asarray(model2.apply({"params": params2}, tokens))

    scale = float(np.abs(jax_logits).max())
    tolerance = RELATIVE_TOLERANCE * max(1.0, scale)
    rows = [("JAX -> torch", float(np.abs(jax_logits - torch_logits).max())),
            ("torch -> JAX", float(np.abs(torch_logits - back_logits).max()))]
    print(f"logits of {batch}x{seq_len} random tokens, float32; max |logit| = {scale:.4g}, "
          f"tolerance {tolerance:.1e}")
    for label, diff in rows:
        print(f"  {label}: max abs difference {diff:.3e}  {'ok' if diff <= tolerance else 'FAIL'}")
    return 0 if all(diff <= tolerance for _, diff in rows) else 1
