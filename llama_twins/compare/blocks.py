"""Where two models part (`llama-bridge compare`'s last section, run when the outputs differ
beyond what the weights explain): each block of A and of B fed the same input, A's hidden state,
so that an error does not carry from one block into the next, and each sub-layer of B fed A's
input to that sub-layer, so that a fault is found where it acts, not where it first shows.

It runs in float64 block by block (llama_twins.float64: one block's weights of each model in
memory at a time, each model with its own config, so that a changed RoPE theta or norm epsilon
acts), on the first TOKENS tokens of the text, after the embedding rows and before the head,
which are compared too (the head in slices of HEAD_ROWS vocabulary entries in float64).

Each part's difference is max |B - A| over a token's features, relative to the largest |A| of
the stream it lands in (a norm's own output; an attention's x + attention; a feed-forward's the
block's output), the largest over the tokens. The rule: a part's level is the median of its
differences over the blocks (what rounding or quantisation gives it everywhere); a block
departs where one of its parts is SPREAD times beyond its level (and beyond FLOOR, which float64
runs of the same float32 weights never reach). The first block that departs, and its first part
that does, are named. Where no block departs from the rest, every block parts alike: a cause the
blocks share (a RoPE or norm field of the config, a layout convention), shown where it first
acts, in block 0's largest part.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from bridge.compare.report import DIFFERENT, SAME, SKIPPED, Finding

from ..float64 import HEAD_ROWS, _block_weights, _Blocks
from ..parity.forward import SUBLAYERS, TENSORS

TOKENS = 128
SPREAD, FLOOR = 4.0, 1e-6
# The fields that must agree for one model's hidden state to go into the other's blocks.
SHAPE = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size",
         "qkv_bias", "qk_norm")


def _relative(a: np.ndarray, b: np.ndarray, stream: np.ndarray) -> float:
    """max over tokens of max |b - a| / max |stream| (a token's features)."""
    scale = np.abs(stream).max(axis=-1, keepdims=True)
    return float((np.abs(b - a) / np.where(scale > 0, scale, 1.0)).max())


def _getter(ckpt, adapter):
    """ckpt.tensor, with `adapter` merged into each tensor it trains (bridge.lora.read_peft)."""
    if adapter is None:
        return ckpt.tensor
    from bridge.lora import read_peft

    lora = read_peft(adapter, ckpt.config)
    return lambda name: lora.merged(name, ckpt.tensor(name))


def part_differences(a, b, tokens: np.ndarray, adapter=None,
                     progress: Callable[[str], object] | None = None) -> dict:
    """{"embedding": d, "blocks": [{part: d, "output": d} per block], "head": d}: each difference
    of B against A as the module's docstring measures it, on `tokens` (1-D ids, A's)."""
    import jax
    import jax.numpy as jnp

    heard = progress or (lambda message: None)
    get_a, get_b = _getter(a, adapter), b.tensor
    tokens = np.asarray(tokens, np.int32)[None, :TOKENS]
    with jax.enable_x64(True):
        run_a, run_b = _Blocks(a.config), _Blocks(b.config)
        mask = jnp.ones(tokens.shape, jnp.int32)
        geometry_a, geometry_b = run_a.geometry(mask), run_b.geometry(mask)
        rows_a = np.asarray(get_a("tok_embeddings.weight")[tokens], np.float64)
        rows_b = np.asarray(get_b("tok_embeddings.weight")[tokens], np.float64)
        found = {"embedding": _relative(rows_a, rows_b, rows_a), "blocks": []}
        x = jnp.asarray(rows_a)
        for i in range(a.config.n_layers):
            heard(f"where they part: block {i + 1} of {a.config.n_layers}")
            w_a = _block_weights(get_a, a.config, i, np.float64)
            w_b = _block_weights(get_b, b.config, i, np.float64)
            out_a, parts_a = run_a.block(w_a, x, *geometry_a)
            out_b, _ = run_b.block(w_b, x, *geometry_b)
            parts_b = run_b.parts(w_b, x, parts_a, *geometry_b)
            mine = {k: np.asarray(v) for k, v in parts_a.items()}
            theirs = {k: np.asarray(v) for k, v in parts_b.items()}
            streams = {"attention": np.asarray(x) + mine["attention"],
                       "feed_forward": np.asarray(out_a)}
            here = {part: _relative(mine[part], theirs[part], streams.get(part, mine[part]))
                    for part in SUBLAYERS}
            here["output"] = _relative(np.asarray(out_a), np.asarray(out_b), np.asarray(out_a))
            found["blocks"].append(here)
            x = out_a
        h_a = run_a.final_norm(jnp.asarray(np.asarray(get_a("norm.weight"), np.float64)), x)
        h_b = run_b.final_norm(jnp.asarray(np.asarray(get_b("norm.weight"), np.float64)), x)
        logits = []
        for ckpt, get, h in ((a, get_a, h_a), (b, get_b, h_b)):
            head = get("tok_embeddings.weight" if ckpt.config.tie_embeddings else "output.weight")
            logits.append(np.concatenate([np.asarray(h) @ np.asarray(head[k:k + HEAD_ROWS],
                                                                     np.float64).T
                                          for k in range(0, head.shape[0], HEAD_ROWS)], axis=-1))
            del head
        found["head"] = _relative(logits[0], logits[1], logits[0])
    return found


def where_they_part(a, b, tokens, adapter=None,
                    progress: Callable[[str], object] | None = None) -> Finding:
    """The blocks Finding (see the module's docstring). a, b: opened checkpoints; tokens: the
    text's ids by A's tokenizer; adapter: a PEFT directory merged into A."""
    apart = [k for k in SHAPE if getattr(a.config, k) != getattr(b.config, k)]
    if apart:
        return Finding("blocks", SKIPPED, f"not run: the models' shapes differ ({', '.join(apart)})")
    found = part_differences(a, b, tokens, adapter, progress)
    blocks = found["blocks"]
    levels = {part: float(np.median([blk[part] for blk in blocks])) for part in SUBLAYERS}
    level = max(max(levels.values()), FLOOR)
    lines = [f"{min(len(tokens), TOKENS)} tokens, each block of A and of B fed A's hidden state "
             f"(float64); a part departs {SPREAD:g}x beyond its median over the blocks",
             "median difference per part: " + ", ".join(f"{p} {v:.2e}" for p, v in levels.items())]
    scores = [{part: blk[part] / max(levels[part], FLOOR) for part in SUBLAYERS} for blk in blocks]
    figures = {"embedding": found["embedding"], "head": found["head"], "blocks": blocks,
               "levels": levels}

    if found["embedding"] > SPREAD * level:
        figures.update(block=None, sublayer="embedding")
        lines.append(f"the embedding rows depart: {found['embedding']:.2e}, the blocks' level "
                     f"{level:.2e}")
        return Finding("blocks", DIFFERENT, "they part at the embedding", lines,
                       cause="the token embedding rows of the text",
                       check_next="tok_embeddings.weight in the weights section", figures=figures)
    departing = next((i for i, s in enumerate(scores)
                      if any(v > SPREAD and blocks[i][p] > FLOOR for p, v in s.items())), None)
    for i, blk in enumerate(blocks[:departing + 1 if departing is not None else 3]):
        lines.append(f"block {i}: " + ", ".join(f"{p} {blk[p]:.2e}" for p in SUBLAYERS +
                                                 ("output",)))
    if departing is not None:
        i = departing
        part = next(p for p in SUBLAYERS if scores[i][p] > SPREAD and blocks[i][p] > FLOOR)
        figures.update(block=i, sublayer=part)
        lines.append(f"block {i}'s {part} departs: {blocks[i][part]:.2e}, "
                     f"{scores[i][part]:.0f}x its level over the blocks")
        return Finding("blocks", DIFFERENT, f"they part at block {i}'s {part}", lines,
                       cause=f"block {i}'s {part}",
                       check_next="the tensors " + ", ".join(f"layers.{i}.{n}"
                                                             for n in TENSORS[part]),
                       figures=figures)
    if found["head"] > max(SPREAD * level, FLOOR):
        figures.update(block=None, sublayer="head")
        lines.append(f"the head departs: {found['head']:.2e}")
        return Finding("blocks", DIFFERENT, "they part at the head (final norm and output)",
                       lines, cause="the head (norm.weight, and output.weight or the tied "
                                    "embedding)",
                       check_next="the config's tie_embeddings and the output tensor's rows",
                       figures=figures)
    if max(blk[p] for blk in blocks for p in SUBLAYERS) > FLOOR:
        part = max(SUBLAYERS, key=lambda p: blocks[0][p])
        figures.update(block=0, sublayer=part)
        lines.append(f"every block parts alike; block 0's largest part is {part} "
                     f"({blocks[0][part]:.2e})")
        check = {"attention": "the config's rope_theta and rope_scaling, and the q/k rows' RoPE "
                              "layout (interleaved or halves)",
                 "attention_norm": "the config's norm_eps", "ffn_norm": "the config's norm_eps",
                 "feed_forward": "the feed-forward tensors' layout (w1 and w3 swapped?)"}[part]
        return Finding("blocks", DIFFERENT, f"every block parts alike, first at block 0's {part}",
                       lines, cause=f"block 0's {part} (every block alike: a cause they share)",
                       check_next=check, figures=figures)
    return Finding("blocks", SAME, "no block, embedding or head departs", lines, figures=figures)
