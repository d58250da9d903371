"""Fine-tuning a real pretrained model for sentiment classification, as a user runs it:
`jax-llama finetune --init CHECKPOINT` with nothing else (the pretrained recipe's defaults), full
and LoRA, on SST-5 (dev) and CFIMDB (a 15% held-out split), then the torch twin's classifier on the
best epoch, which must predict the same labels. Writes results/train/finetune_pretrained.{json,md}
and a plot of dev accuracy per epoch (results/train/finetune_pretrained.png).

    python scripts/finetune_pretrained.py CHECKPOINT [--runs sst-full,sst-lora,cfimdb-full,...]
        [--data ../shared/data] [--work runs/finetune-pretrained] [--out results/train]

Runs already finished in --work (their metrics.jsonl complete) are read, not run again, so the
table can be built over several sessions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from llama_twins import results
from llama_twins.bench.common import cpu_model

RUNS = {  # name: (task, extra flags)
    "sst-full": ("sst", []),
    "sst-lora": ("sst", ["--lora-rank", "8"]),
    "cfimdb-full": ("cfimdb", []),
    "cfimdb-lora": ("cfimdb", ["--lora-rank", "8"]),
}
TARGETS = {"sst": 0.50, "cfimdb": 0.92}


def task_files(task: str, data: Path, work: Path) -> tuple[Path, Path, Path]:
    """(train, dev, labels) of a task; CFIMDB's dev is `jax-llama split`'s held-out 15%."""
    if task == "sst":
        return data / "sst/train.txt", data / "sst/dev.txt", data / "sst/labels.json"
    split = work / "cfimdb-split"
    if not (split / "heldout.txt").is_file():
        subprocess.run([sys.executable, "-m", "llama_twins.cli.main", "split",
                        str(data / "cfimdb/train.txt"), "--fraction", "0.15", "--seed", "0",
                        "--out", str(split)], check=True)
    return split / "train.txt", split / "heldout.txt", data / "cfimdb/labels.json"


def torch_agreement(run: Path, dev: Path) -> dict:
    """The torch twin's classifier (torch_llama.load_classifier) on the best epoch against the
    JAX predictions the run wrote for the dev file."""
    import torch_llama
    from tasks.classification import read_examples
    from jax_llama.training.finetune import classifier_dir

    clf = torch_llama.load_classifier(classifier_dir(run), device="cpu")
    texts = read_examples(dev, len(clf.labels)).texts
    predictions = torch_llama.predict(clf, texts)[0]
    jax_predictions = [int(x) for x in (run / "dev_predictions.txt").read_text().split()]
    same = sum(int(a) == b for a, b in zip(predictions, jax_predictions))
    return {"same": same, "of": len(jax_predictions)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data"))
    parser.add_argument("--work", default="runs/finetune-pretrained")
    parser.add_argument("--out", default="results/train")
    args = parser.parse_args(argv)
    data, work = Path(args.data), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name in args.runs.split(","):
        task, flags = RUNS[name]
        train, dev, labels = task_files(task, data, work)
        run = work / name
        command = [sys.executable, "-m", "llama_twins.cli.main", "finetune", "--init",
                   args.checkpoint, "--train", str(train), "--dev", str(dev), "--labels",
                   str(labels), "--out", str(run), *flags]
        wall = None
        if not (run / "summary.json").is_file():
            started = time.perf_counter()
            done = subprocess.run(command, check=False, stderr=subprocess.PIPE, text=True)
            wall = time.perf_counter() - started
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            header = next(line for line in done.stderr.splitlines()
                          if line.startswith("fine-tuning "))
            records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            # a line a step; an epoch's last step's line holds its dev figures
            history = [r for r in records if "epoch" in r]
            for r in history:  # the epoch's speed: the median of its steps'
                r["tokens_per_s"] = statistics.median(
                    x["tokens_per_s"] for x in records
                    if r["step"] - len(records) // len(history) < x["step"] <= r["step"])
            (run / "summary.json").write_text(json.dumps(
                {"command": " ".join(["jax-llama", *command[3:]]), "wall_s": round(wall, 1),
                 "recipe": header, "history": history, "cpu": cpu_model(),
                 "torch": torch_agreement(run, dev)}, indent=2) + "\n")
        rows[name] = {"task": task, **json.loads((run / "summary.json").read_text())}
        best = max(r["dev_accuracy"] for r in rows[name]["history"])
        print(f"{name}: best dev {best:.4f} in {rows[name]['wall_s']} s", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    earlier = out / "finetune_pretrained.json"
    if earlier.is_file():  # runs of earlier sessions (machines) stay in the table
        old = json.loads(earlier.read_text())
        for name, row in old["runs"].items():
            row.setdefault("cpu", old.get("cpu"))
        rows = {**{k: v for k, v in old["runs"].items() if k not in rows}, **rows}
        rows = {k: rows[k] for k in RUNS if k in rows}
    result = {"checkpoint": Path(args.checkpoint).name, "cores": os.cpu_count(),
              "targets": TARGETS, "runs": rows}
    lines = [f"# Fine-tuning {Path(args.checkpoint).name} (`finetune --init`, its defaults)", "",
             (f"{result['cores']} cores (each run's CPU in its row); `python scripts/finetune_pretrained.py "
              f"{Path(args.checkpoint).name}`. Dev: SST-5 dev (1,101), CFIMDB `split --fraction "
              f"0.15 --seed 0` held-out (256). Targets: SST-5 >= 50%, CFIMDB >= 92%, LoRA within "
              f"2 points of full, each run <= 60 minutes."), "",
             "| run | CPU | recipe | dev accuracy per epoch | best | target | wall (min) | tokens/s | "
             "torch twin agrees |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        accs = [h["dev_accuracy"] for h in r["history"]]
        speed = [h.get("tokens_per_s") for h in r["history"] if h.get("tokens_per_s")]
        best = max(accs)
        lines.append(
            f"| {name} | {r['cpu']} | {r['recipe'].split('; ', 1)[-1]} | {', '.join(f'{a:.4f}' for a in accs)} "
            f"| {best:.4f} {'meets' if best >= TARGETS[r['task']] else 'below'} | "
            f"{TARGETS[r['task']]:.2f} | {r['wall_s'] / 60:.1f} | "
            f"{sum(speed) / len(speed):.0f} | {r['torch']['same']}/{r['torch']['of']} |"
            if speed else f"| {name} | ... |")
    print(results.write("finetune_pretrained", result, lines, out), end="")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in rows.items():
        ax.plot([h["epoch"] for h in r["history"]], [h["dev_accuracy"] for h in r["history"]],
                marker="o", label=name)
    for task, target in TARGETS.items():
        if any(r["task"] == task for r in rows.values()):
            ax.axhline(target, linestyle=":", color="grey")
    ax.set_xlabel("epoch")
    ax.set_ylabel("dev accuracy")
    ax.set_title(f"finetune --init {Path(args.checkpoint).name}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "finetune_pretrained.png", dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
