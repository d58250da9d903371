"""Long context: the train step (forward, backward, AdamW) at a fixed number of tokens per batch as
the sequence grows - S = 512 ... 16384 with B = tokens / S - for jax-llama with the `xla`
attention (scores materialised) and `chunked` (flash-style), and transformers with `sdpa` and
`eager`, on the bench config. Tokens/s and the peak memory of the worker process (one process per
implementation and length, so that each figure is its own), side by side in one run, with a plot.

A point whose materialised scores alone (and their softmax and gradient) would exceed the memory
budget is not run, and the table says so: on a 24 GB machine the xla and eager paths stop at a
few thousand tokens.

    python -m llama_twins.bench.long [--quick] [--out DIR]   # or: jax-llama bench --only long
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

from bridge.config import PRESETS

from .common import (CONFIG, REFERENCE, Spec, WorkerFailed, describe, ratio, say, spawn, timed,
                     write_results)

SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
TOKENS = 16384
QUICK = dict(seq_lens=(64, 256), tokens=256)
VARIANTS = {  # label -> (implementation, attention)
    "jax-llama xla": ("jax-llama", "xla"),
    "jax-llama chunked": ("jax-llama", "chunked"),
    "transformers sdpa": (REFERENCE, "sdpa"),
    "transformers eager": (REFERENCE, "eager"),
}
MATERIALISED = ("jax-llama xla", "transformers eager")


def budget_bytes() -> int:
    """Half of this machine's memory: what a point may plan to use for its attention scores."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def scores_bytes(spec: Spec, variant: str) -> int:
    """What the materialised attention keeps for the backward pass: float32 scores and
    probabilities of every layer, (B, N, S, S) each; zero for the fused implementations."""
    if variant not in MATERIALISED:
        return 0
    c = spec.config
    return 2 * 4 * c.n_layers * spec.batch * c.n_heads * spec.seq_len ** 2


def measure(variant: str, spec: Spec) -> dict:
    """In a worker: seconds per train step and the process's peak resident memory."""
    from .train import jax_step, torch_step

    implementation, attention = VARIANTS[variant]
    if implementation == REFERENCE:
        step, sync = torch_step(spec, implementation, attention)
    else:
        step, sync = jax_step(spec, attention)
    runs = timed(step, spec.warmup, spec.repeats, sync)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return {"runs_s": runs, "peak_rss_bytes": peak}


def run(seq_lens=SEQ_LENS, tokens: int = TOKENS, config=CONFIG, dtype: str = "float32",
        warmup: int = 1, repeats: int = 2, variants=tuple(VARIANTS), transformers: bool = True) -> dict:
    """Every (variant, S) point, each in a worker process of its own."""
    rows = {v: {} for v in variants}
    config = config.replace(max_seq_len=max(config.max_seq_len, max(seq_lens)))
    for S in seq_lens:
        spec = Spec(config=config, dtype=dtype, batch=max(tokens // S, 1), seq_len=S,
                    warmup=warmup, repeats=repeats)
        for variant in variants:
            if variant.startswith("transformers") and not transformers:
                rows[variant][str(S)] = {"skipped": "transformers is not installed"}
                continue
            need = scores_bytes(spec, variant)
            if need > budget_bytes():
                rows[variant][str(S)] = {"skipped": f"its scores need {need / 2**30:.0f} GiB"}
                say(f"S {S}: {variant} skipped ({rows[variant][str(S)]['skipped']})")
                continue
            started = time.perf_counter()
            try:
                result = spawn("long", spec, extra=("--variant", variant))
            except WorkerFailed as e:  # an out-of-memory kill, or a failure: said, not fatal
                result = {"skipped": _failure(str(e))}
            if "runs_s" in result:
                result["tokens_per_s"] = spec.batch * S / statistics.median(result["runs_s"])
            rows[variant][str(S)] = result
            say(f"S {S} x B {spec.batch}: {variant} in {time.perf_counter() - started:.0f} s")
    for S in map(str, seq_lens):
        base = rows.get("transformers sdpa", {}).get(S, {}).get("tokens_per_s")
        for points in rows.values():
            if "tokens_per_s" in points.get(S, {}):
                points[S]["vs_sdpa"] = points[S]["tokens_per_s"] / base if base else None
    return {"tokens": tokens, "seq_lens": list(seq_lens), "config": config.to_dict(),
            "dtype": dtype, "warmup": warmup, "repeats": repeats, "rows": rows}


def _failure(message: str) -> str:
    first = message.splitlines()[0].rstrip(":")
    return "killed (out of memory)" if "exited with -9" in first else f"failed: {first}"


def markdown(result: dict) -> list[str]:
    lines = [f"## Long context: the train step at {result['tokens']:,} tokens per batch "
             f"(B = {result['tokens']:,} / S), {result['dtype']}, one worker process per point, "
             f"{result['warmup']} warm-up and {result['repeats']} timed steps each (the median); "
             f"peak RSS of the process", "",
             "| implementation | " + " | ".join(f"S {S}" for S in result["seq_lens"]) + " |",
             "|---|" + "---|" * len(result["seq_lens"])]
    for variant, points in result["rows"].items():
        cells = []
        for S in map(str, result["seq_lens"]):
            p = points.get(S, {})
            if "skipped" in p:
                reason = p["skipped"]
                if reason.startswith("failed: ") and "exited with -9" in reason:
                    reason = _failure(reason[len("failed: "):])
                cells.append(reason if reason.startswith("killed") else f"not run: {reason}")
            else:
                cells.append(f"{p['tokens_per_s']:,.0f} tok/s ({ratio(p.get('vs_sdpa'))} sdpa), "
                             f"{p['peak_rss_bytes'] / 2**30:.1f} GiB")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return lines


def plot(result: dict, path) -> str | None:
    """tokens/s and peak memory against S, one line per implementation (PNG)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4))
    for variant, points in result["rows"].items():
        lens = [int(S) for S, p in points.items() if "tokens_per_s" in p]
        if not lens:
            continue
        speed.plot(lens, [points[str(S)]["tokens_per_s"] for S in lens], "o-", label=variant)
        memory.plot(lens, [points[str(S)]["peak_rss_bytes"] / 2**30 for S in lens], "o-",
                    label=variant)
    for ax, label in ((speed, "train-step tokens/s"), (memory, "peak memory of the process (GiB)")):
        ax.set(xscale="log", xlabel="sequence length S (B = tokens / S)", ylabel=label)
        ax.set_xticks(result["seq_lens"], [str(S) for S in result["seq_lens"]])
        ax.grid(alpha=0.3)
    speed.legend()
    fig.suptitle(f"Train step at {result['tokens']:,} tokens per batch, {result['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def main(argv=None) -> int:
    from .common import available, probe

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny preset at S 64 and 256")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=".", help="directory for long.{md,json,png} (default .)")
    args = parser.parse_args(argv)
    found = probe()
    kw = dict(QUICK, config=PRESETS["tiny"]) if args.quick else {}
    result = run(repeats=args.repeats, transformers=REFERENCE in available(found), **kw)
    lines = [describe(kw.get("config", CONFIG)), "", *markdown(result)]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    plotted = plot(result, Path(args.out) / "long.png")
    write_results("long", lines, result, args.out)
    if plotted:
        say(f"plot: {plotted}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
