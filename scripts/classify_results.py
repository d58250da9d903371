"""SST-5 and CFIMDB results: zero-shot, fine-tuned from scratch, fine-tuned after continued
pretraining - every figure produced by a `jax-llama` command, run here one after another, with its
wall and CPU time.

    python scripts/classify_results.py [--data ../shared/data] [--out runs/classify]

Writes OUT/classify.md and OUT/classify.json (the repository keeps the last ones in
results/classify/). CFIMDB has no dev file: 15% of its train
file is held out first (`jax-llama split`, seed 0), and nothing held out is trained on, not even
as unlabeled text. The continued-pretraining language model is trained once, on the texts (labels
stripped) of SST train and the CFIMDB training part, and used by both tasks, so its time counts
in both totals.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

from llama_twins.bench.common import write_results

ROOT = Path(__file__).resolve().parents[1]
ACCURACY = re.compile(r"(?:best dev|zero-shot|classifier) accuracy ([0-9.]+)")


def run(command: list[str], log: Path) -> dict:
    """Run a command; its stdout+stderr go to `log`. Returns wall and CPU seconds (children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    print("$ " + shlex.join(command), file=sys.stderr, flush=True)
    with log.open("w") as f:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=f, text=True, cwd=ROOT)
        f.write(done.stdout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {shlex.join(command)}; see {log}")
    match = ACCURACY.search(done.stdout)
    print(done.stdout.strip(), file=sys.stderr)
    return {"command": shlex.join(command), "wall_s": time.perf_counter() - start,
            "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "accuracy": float(match.group(1)) if match else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    parser.add_argument("--out", default="runs/classify")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--lm-steps", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="fine-tuning seeds (each a full run; the table shows each and the mean)")
    parser.add_argument("--lora-rank", type=int, default=8, help="of the LoRA rows (alpha 2 x rank)")
    parser.add_argument("--lora-lr", type=float, default=5e-3, help="peak lr of the LoRA rows")
    parser.add_argument("--lora-epochs", type=int, default=12,
                        help="epochs of the LoRA rows (the adapters start at zero and learn slower)")
    parser.add_argument("--name", default="classify", help="results file name (OUT/NAME.md, .json)")
    parser.add_argument("--methods", default="zero-shot,scratch,pretrained,lora,lora-emb",
                        help="comma-separated subset of the rows to run")
    parser.add_argument("--reuse-lm", action="store_true",
                        help="use OUT/lm/model when it exists instead of training the LM again")
    args = parser.parse_args()
    methods = set(args.methods.split(","))
    data, out = Path(args.data), Path(args.out)
    if not (data / "sst" / "train.txt").is_file():
        sys.exit(f"{data}: no sst/train.txt (pass --data)")
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    sst, cf = data / "sst", out / "cfimdb"
    tasks = {
        "SST-5 dev": {"train": sst / "train.txt", "dev": sst / "dev.txt", "labels": sst / "labels.json"},
        "CFIMDB held-out 15%": {"train": cf / "train.txt", "dev": cf / "heldout.txt",
                                "labels": data / "cfimdb" / "labels.json"},
    }
    steps = {}
    steps["split"] = run(["jax-llama", "split", str(data / "cfimdb" / "train.txt"),
                          "--fraction", "0.15", "--seed", "0", "--out", str(cf), "--force"],
                         logs / "split.log")
    lm = out / "lm"
    if args.reuse_lm and (lm / "model").is_dir():
        steps["lm"] = json.loads((lm / "step.json").read_text())
    else:
        steps["lm"] = run(["jax-llama", "train", "--data", str(sst / "train.txt"), str(cf / "train.txt"),
                           "--strip-labels", "--preset", args.preset, "--vocab-size",
                           str(args.vocab_size), "--steps", str(args.lm_steps), "--batch-size", "32",
                           "--seq-len", "128", "--eval-every", "500", "--checkpoint-every", "1000",
                           "--sample-tokens", "0",
                           "--out", str(lm)], logs / "lm.log")
        (lm / "step.json").write_text(json.dumps(steps["lm"]))
    rows = []
    for name, task in tasks.items():
        key = "sst" if name.startswith("SST") else "cfimdb"
        common = ["--train", str(task["train"]), "--dev", str(task["dev"]),
                  "--labels", str(task["labels"])]
        epochs = ["--epochs", str(args.epochs)]
        zero_shot = (("zero-shot (the continued-pretraining LM)", []),
                     ("zero-shot, --calibrate", ["--calibrate"]))
        for method, flags in zero_shot if "zero-shot" in methods else ():
            rows.append({"task": name, "method": method, **run(
                ["jax-llama", "zero-shot", str(lm / "model"), "--data", str(task["dev"]),
                 "--labels", str(task["labels"]), *flags,
                 "--out", str(out / f"{key}-zero-shot{'-calibrated' if flags else ''}.txt")],
                logs / f"{key}-zero-shot{'-calibrated' if flags else ''}.log")})
        lora = f"LoRA rank {args.lora_rank} (all seven projections, and the head) after continued pretraining"
        for tag, method, extra in (
                ("scratch", "fine-tuned from scratch",
                 [*epochs, "--preset", args.preset, "--vocab-size", str(args.vocab_size)]),
                ("pretrained", "fine-tuned after continued pretraining",
                 [*epochs, "--init", str(lm / "model")]),
                ("lora", lora, ["--init", str(lm / "model"), "--lora-rank", str(args.lora_rank),
                                "--lr", str(args.lora_lr), "--epochs", str(args.lora_epochs)]),
                ("lora-emb", lora.replace("and the head", "the embedding table and the head"),
                 ["--init", str(lm / "model"), "--lora-rank", str(args.lora_rank),
                  "--lora-train-embeddings", "--lr", str(args.lora_lr),
                  "--epochs", str(args.lora_epochs)])):
            if tag not in methods:
                continue
            runs = [run(["jax-llama", "finetune", *common, *extra, "--seed", str(seed),
                         "--out", str(out / f"{key}-{tag}-seed{seed}")],
                        logs / f"{key}-{tag}-seed{seed}.log") for seed in args.seeds]
            accuracies = [r["accuracy"] for r in runs]
            rows.append({"task": name, "method": method, "seeds": args.seeds,
                         "accuracies": accuracies, "accuracy": sum(accuracies) / len(runs),
                         "wall_s": runs[0]["wall_s"], "cpu_s": runs[0]["cpu_s"],
                         "command": runs[0]["command"],
                         **({"plus_lm": {k: steps["lm"][k] for k in ("wall_s", "cpu_s")}}
                            if tag != "scratch" else {})})
    write(rows, steps, args)


def write(rows: list[dict], steps: dict, args) -> None:
    machine = f"{platform.machine()}, {__import__('os').cpu_count()} CPU cores, Python {platform.python_version()}"
    lines = ["# Sequence classification results\n", f"`python scripts/classify_results.py` "
             f"(preset {args.preset}, {args.vocab_size}-token BPE, {args.epochs} epochs ({args.lora_epochs} for "
             f"LoRA rows, lr {args.lora_lr:g}), LM "
             f"{args.lm_steps} steps) on {machine}; {time.strftime('%Y-%m-%d')}.\n",
             f"Continued-pretraining LM: {steps['lm']['wall_s']:.0f} s wall, "
             f"{steps['lm']['cpu_s']:.0f} s CPU (`{steps['lm']['command']}`).\n",
             "Fine-tuned rows: the mean over seeds, each seed's best-epoch dev accuracy in "
             "brackets; time and command of one seed's run (the first). Pretrained rows add the "
             "LM's time once.\n",
             "| task | method | accuracy | wall s | CPU s | command |", "|---|---|---|---|---|---|"]
    for r in rows:
        acc = f"{r['accuracy']:.4f}"
        if "accuracies" in r:
            acc += " [" + ", ".join(f"{a:.4f}" for a in r["accuracies"]) + "]"
        wall, cpu = f"{r['wall_s']:.0f}", f"{r['cpu_s']:.0f}"
        if "plus_lm" in r:
            wall += f" + {r['plus_lm']['wall_s']:.0f}"
            cpu += f" + {r['plus_lm']['cpu_s']:.0f}"
        lines.append(f"| {r['task']} | {r['method']} | {acc} | {wall} | {cpu} | `{r['command']}` |")
    write_results(args.name, lines, {"rows": rows, "steps": steps, "machine": machine}, args.out)


if __name__ == "__main__":
    main()
