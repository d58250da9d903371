"""lm-evaluation-harness throughput, requests per second: the model `jax-llama` on a native
checkpoint against lm-eval's own `hf` model on its `llama-bridge convert --to hf` copy, on two
local tasks written to a temporary directory (no download):

- `jl_choice`: ITEMS multiple-choice questions with 4 one-word answers (loglikelihood requests,
  4 per question);
- `jl_complete`: PROMPTS greedy completions of up to 32 tokens, stopping at a blank line
  (generate_until requests).

    python scripts/harness_throughput.py runs/main/model runs/main/hf [--out results/quality]
        [--repeats 3]

Each model is built once and runs each task `--repeats` times through lm_eval.simple_evaluate
(the first run includes JAX's compilations; the median is the figure); requests/s = the task's
requests / the wall seconds of simple_evaluate. Writes OUT/harness.json and OUT/harness.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np

from llama_twins import results

ITEMS = 200
PROMPTS = 40
WORDS = ("def class return import self value print list dict string number index object "
         "module error token window layer model train batch").split()


def write_tasks(directory: Path) -> Path:
    """The two tasks' JSONL files and YAMLs in `directory` (for TaskManager(include_path=))."""
    rng = np.random.default_rng(0)
    with open(directory / "choice.jsonl", "w") as f:
        for i in range(ITEMS):
            choices = [str(w) for w in rng.choice(WORDS, 4, replace=False)]
            f.write(json.dumps({"question": f"def f{i}(x):\n    # the {choices[0]} of x",
                                "choices": choices, "label": int(rng.integers(4))}) + "\n")
    with open(directory / "complete.jsonl", "w") as f:
        for i in range(PROMPTS):
            f.write(json.dumps({"prompt": f"def {rng.choice(WORDS)}_{i}(self, "
                                          f"{rng.choice(WORDS)}):\n", "answer": "    return"}) + "\n")
    common = "test_split: test\nmetadata:\n  version: 1.0\n"
    (directory / "jl_choice.yaml").write_text(f"""\
task: jl_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {directory / 'choice.jsonl'}
output_type: multiple_choice
doc_to_text: "{{{{question}}}}\\n    return"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
{common}""")
    (directory / "jl_complete.yaml").write_text(f"""\
task: jl_complete
dataset_path: json
dataset_kwargs:
  data_files:
    test: {directory / 'complete.jsonl'}
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 32
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
{common}""")
    return directory


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("native", help="a checkpoint jax_llama.load reads (with its tokenizer)")
    p.add_argument("hf", help="its Hugging Face copy (llama-bridge convert NATIVE HF --to hf)")
    p.add_argument("--out", default=".", help="directory for harness.json / harness.md")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="harness-throughput-"))
    # datasets' cache and the hub stay in the temporary directory, offline
    os.environ.update(HF_HOME=str(work / "hf-home"), HF_DATASETS_CACHE=str(work / "datasets"),
                      HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from jax_llama.harness import JaxLlamaLM

    tasks = TaskManager(include_path=str(write_tasks(work)), include_defaults=False)
    from lm_eval.tasks import get_task_dict

    get_task_dict(["jl_choice", "jl_complete"], tasks)  # datasets prepared before any timing
    requests = {"jl_choice": 4 * ITEMS, "jl_complete": PROMPTS}
    models = {"jax-llama": lambda: JaxLlamaLM(pretrained=args.native, batch_size=args.batch_size),
              "hf": lambda: HFLM(pretrained=args.hf, dtype="float32", device="cpu",
                                 batch_size=args.batch_size)}
    rows, samples = [], {}
    for name, build in models.items():
        lm = build()
        for task in requests:
            seconds, metric = [], None
            for _ in range(args.repeats):
                started = time.perf_counter()
                out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=tasks,
                                              log_samples=True, verbosity="WARNING")
                seconds.append(time.perf_counter() - started)
                samples[name, task] = sorted(out["samples"][task], key=lambda s: s["doc_id"])
                result = out["results"][task]
                metric = result.get("acc,none", result.get("exact_match,none"))
            median = statistics.median(seconds)
            rows.append({"model": name, "task": task, "requests": requests[task],
                         "batch_size": args.batch_size, "seconds": seconds,
                         "median_seconds": median, "requests_per_second": requests[task] / median,
                         "metric": metric})
            print(f"{name:10} {task:12} {requests[task] / median:8.1f} requests/s  "
                  f"({', '.join(f'{s:.2f}' for s in seconds)} s)", file=sys.stderr)

    # Do the two models answer alike? Per-choice log-likelihoods, and the completions' texts.
    ours, theirs = samples["jax-llama", "jl_choice"], samples["hf", "jl_choice"]
    agreement = {
        "jl_choice_max_abs_loglikelihood_difference": max(
            abs(float(a[0]) - float(b[0])) for x, y in zip(ours, theirs)
            for a, b in zip(x["filtered_resps"], y["filtered_resps"])),
        "jl_complete_identical_texts": sum(
            x["filtered_resps"] == y["filtered_resps"] for x, y in
            zip(samples["jax-llama", "jl_complete"], samples["hf", "jl_complete"])),
    }
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    record = {"date": date.today().isoformat(), "cpu": cpu, "cores": os.cpu_count(),
              "lm_eval": lm_eval.__version__, "native": args.native, "hf": args.hf,
              "repeats": args.repeats, "rows": rows, "agreement": agreement}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"lm-eval {lm_eval.__version__}, {cpu}, {os.cpu_count()} cores, {record['date']}; "
             f"`{args.native}` (jax-llama) and `{args.hf}` (hf), batch size {args.batch_size}, "
             f"median of {args.repeats} runs (the first includes JAX's compilations)", "",
             "| model | task | requests | requests/s | seconds (each run) | acc / exact match |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['model']}` | {r['task']} | {r['requests']} | "
                     f"{r['requests_per_second']:.1f} | "
                     f"{', '.join(f'{s:.2f}' for s in r['seconds'])} | {r['metric']:.3f} |")
    lines += ["", f"The two agree: per-choice log-likelihoods within "
              f"{agreement['jl_choice_max_abs_loglikelihood_difference']:.1e} (absolute), "
              f"{agreement['jl_complete_identical_texts']} of {PROMPTS} completions identical."]
    print(results.write("harness", record, lines, out), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
