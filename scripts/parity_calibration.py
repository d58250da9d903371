"""Calibrate the parity report's rounding budgets on correct checkpoints, and measure what they
catch.

For each checkpoint and dtype: the report on the correct twins (against transformers, and against
llama.cpp where it is installed), and the report with each bug of llama_twins/parity/planted.py
in one twin (alternating between the twins; the float32-only bugs in float32 only). The work is
cut into parts so that each takes at most half an hour on two cores (`--part I/K`: the I-th of K
slices of the jobs); each part writes results/parity/parts/<isa>-<checkpoints>-<I>-of-<K>.json,
and `--table` gathers every part into results/parity/parity.json and .md: for each figure the
largest error of a correct implementation against its budget, no false FAIL allowed; for each bug
whether it is caught, the twin and the block and part named, and how far beyond its budget it
lands.

    python scripts/parity_calibration.py smollm2=PATH sft-lora=PATH ... --part 1/6 [--isa avx2]
    python scripts/parity_calibration.py --table

--isa avx2 runs the AVX2 code paths on an AVX-512 machine (XLA, the decode kernels, torch's
ATen and oneDNN), as an AVX2-only CPU runs them natively; the part's file records the CPU, its
vector extensions and the path taken.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

DTYPES = ("float32", "bfloat16")
REFERENCES = ("transformers", "llama.cpp")


def cpu_flags() -> list[str]:
    """The vector extensions of this CPU that decide the code paths (from /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")
    return [f for f in wanted if f in flags]


# The bugs of the optimizer, which only the training figures see; the others are in the model,
# and their reports run without the training figures (--no-training: a third of the time).
OPTIMIZER_BUGS = ("decay_mask", "no_clipping", "no_zero_grad")


def jobs_of(checkpoints: dict[str, str], references, planted_bugs=None,
            correct: bool = True, both: bool = False, dtypes=DTYPES) -> list[tuple]:
    """(checkpoint, dtype, reference, bug, twin, training): per checkpoint and dtype, the correct
    report with the training figures against transformers, and without them against llama.cpp
    (its figures are the logits and greedy tokens), then each bug (planted_bugs: those to
    plant, default all) in one twin, alternating (both: in both twins at once); in each of
    `dtypes`."""
    from llama_twins.parity.planted import BUGS, FLOAT32_ONLY, TORCH_ONLY

    jobs = []
    for k, name in enumerate(checkpoints):
        for dtype in dtypes:
            jobs += [(name, dtype, reference, None, None, reference != "llama.cpp")
                     for reference in references if correct]
            bugs = [b for b in BUGS if (dtype == "float32" or b not in FLOAT32_ONLY)
                    and (planted_bugs is None or b in planted_bugs)]
            if both:  # a bug only one twin can have is not planted in both
                bugs = [b for b in bugs if b not in TORCH_ONLY]
            jobs += [(name, dtype, None, bug, "both" if both else "torch" if bug in TORCH_ONLY
                      else ("torch", "JAX")[(i + k) % 2],
                      bug in OPTIMIZER_BUGS) for i, bug in enumerate(bugs)]
    # per checkpoint and dtype, the reports with the training figures first: the later ones
    # reuse their float64 run (reuse_float64_runs)
    names = list(checkpoints)
    return sorted(jobs, key=lambda j: (names.index(j[0]), DTYPES.index(j[1]), not j[5]))


def rows_of(report: dict) -> list[dict]:
    return [{k: c.get(k) for k in ("figure", "compared", "kind", "dtype", "ops", "storage",
                                   "spread", "value", "errors", "tolerance", "margin", "ok",
                                   "culprit", "scale")}
            for c in report["checks"]]


BUDGETED = ("hidden", "logits", "loss", "grad_norm", "grad", "adamw", "optimizer", "rope", "norm",
            "weights")


def ratio(row: dict, name: str | None = None) -> float:
    """An implementation's error (the largest, or `name`'s; "both": the largest) / its budget
    under today's BUDGET and SPREAD_MULTIPLE (the rows keep the raw errors and the perturbed
    runs' spread, so the table follows a change of the budgets)."""
    from llama_twins.parity import budget

    error = (max(row["errors"].values()) if name in (None, "both")
             else row["errors"].get(name, 0.0))
    return error / budget(row["dtype"], row["kind"], row["ops"] or 1, row["storage"] or 0.0,
                          row.get("spread"))


def passes(result: dict) -> bool:
    """The report's verdict under today's BUDGET: every budgeted figure's errors within it, the
    other figures (KL, greedy tokens, llama.cpp's own bound) as they were judged."""
    return all(ratio(row) <= 1 if row["kind"] in BUDGETED and row["errors"] else row["ok"]
               for row in result["rows"])


def culprit(result: dict, compared: str = "torch vs JAX") -> str | None:
    """Who the report names under today's budgets: the implementations beyond their budget on
    the first budgeted figure of `compared` that fails (as the report's own culprit, which a
    report run with other budgets may not have named), else the report's own."""
    for row in result["rows"]:
        if row["compared"] == compared and row["kind"] in BUDGETED and row["errors"]:
            beyond = [name for name in row["errors"] if ratio(row, name) > 1]
            if beyond:
                return " and ".join(beyond)
    return result["culprit"].get(compared)


def reuse_float64_runs() -> dict:
    """The float64 run depends on the checkpoint, the dtype and the batch, not on a bug planted in
    a twin: within a part, the reports of one checkpoint and dtype run one after another, and
    the last float64 run is kept for them (its dicts copied: the report empties its own).
    Returns the state whose "key" the caller sets before each report."""
    import dataclasses

    from llama_twins import float64

    original, state = float64.truth, {"key": None, "last": None}

    def truth(tensors, config, tokens, mask, adamw, **kwargs):
        last = state["last"]
        if last is None or last[0] != state["key"] or (adamw is not None and not last[1].grads):
            state["last"] = None  # freed before the next run
            state["last"] = (state["key"], original(tensors, config, tokens, mask, adamw,
                                                    **kwargs))
        kept = state["last"][1]
        return dataclasses.replace(kept, grads=dict(kept.grads), trained=dict(kept.trained))
    float64.truth = truth
    return state


def run_part(checkpoints: dict[str, str], part: int, parts: int, isa: str, out: Path,
             planted_bugs=None, correct: bool = True, both: bool = False,
             training_lr: float | None = None, dtypes=DTYPES) -> Path:
    from tqdm import tqdm

    from llama_twins.bench.common import cpu_model
    from llama_twins.parity import parity_report
    from llama_twins.parity.planted import planted

    # llama.cpp picks its own instructions at run time (the AVX2 switches do not reach it), so
    # it is a reference on the native path only
    references = [r for r in REFERENCES
                  if r != "llama.cpp" or (isa == "native" and _has_llama_cpp())]
    jobs = jobs_of(checkpoints, references, planted_bugs, correct, both, dtypes)
    size = -(-len(jobs) // parts)
    jobs = jobs[(part - 1) * size:part * size]
    results, started, reuse = [], time.time(), reuse_float64_runs()
    from llama_twins.parity import BUDGET

    target = out / "parts" / (f"{isa}-{'+'.join(checkpoints)}-{part}-of-{parts}"
                              + ("" if correct else "-bugs")
                              + ("-" + "+".join(planted_bugs) if planted_bugs else "")
                              + ("-both" if both else "")
                              + (f"-lr{training_lr:g}" if training_lr else "")
                              + ("" if tuple(dtypes) == DTYPES else "-" + "+".join(dtypes))
                              + ".json")
    target.parent.mkdir(parents=True, exist_ok=True)
    for name, dtype, reference, bug, twin, training in tqdm(jobs, desc=f"part {part}/{parts}",
                                                            unit="report"):
        path, begun = checkpoints[name], time.time()
        reuse["key"] = (name, dtype)
        if bug is None:
            report = parity_report(path, dtype=dtype, reference=reference, training=training,
                                   training_lr=training_lr)
        else:
            with planted(bug, twin, path, dtype) as kwargs:
                report = parity_report(path, dtype=dtype, new_tokens=0, training=training,
                                       training_lr=training_lr, **kwargs)
        results.append({"checkpoint": name, "path": path, "dtype": dtype, "isa": isa,
                        "reference": reference, "bug": bug, "twin": twin, "training": training,
                        "training_lr": training_lr,
                        "passed": report["passed"], "first_divergence": report["first_divergence"],
                        "culprit": report["culprit"], "nearest_part": report["nearest_part"],
                        "seconds": round(time.time() - begun, 1), "rows": rows_of(report)})
        # written after every report, so that a part cut short keeps what it measured
        meta = {"cpu": cpu_model(), "flags": cpu_flags(), "isa": isa, "part": f"{part}/{parts}",
                "seconds": round(time.time() - started), "checkpoints": checkpoints,
                "budget": BUDGET, "done": f"{len(results)} of {len(jobs)}"}
        target.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    return target


def _has_llama_cpp() -> bool:
    from llama_twins import llama_cpp_reference

    return llama_cpp_reference.unavailable() is None


def table(out: Path) -> str:
    """Gather results/parity/parts/*.json into parity.json and parity.md; returns the markdown."""
    from llama_twins.results import write

    from llama_twins.parity import BUDGET

    today = json.loads(json.dumps(BUDGET))
    metas, results = [], {}
    for path in sorted((out / "parts").glob("*.json"), key=lambda p: p.stat().st_mtime):
        data = json.loads(path.read_text())
        metas.append(data["meta"])
        for r in data["results"]:  # a later run of the same report replaces an earlier one
            # where a report places a failure depends on the budgets it ran with: only the
            # parts run with today's (and the placement by each part's own error, which parts
            # written report by report, "done", have) count for the placement column
            r["placed"] = "done" in data["meta"] and data["meta"].get("budget") == today
            results[tuple(r.get(k) for k in ("checkpoint", "dtype", "isa", "reference", "bug",
                                             "twin", "training", "training_lr"))] = r
    results = list(results.values())
    text = markdown(metas, results)
    # the gathered file keeps what the tables are made of (the parts keep every row and field)
    slim = [{**{k: v for k, v in r.items() if k not in ("rows", "path")},
             "rows": _slim_rows(r["rows"])} for r in results]
    write("parity", {"meta": metas, "results": slim}, text.splitlines(), out)
    return text


def _slim_rows(rows: list[dict]) -> list[dict]:
    """Of each kind of budgeted figure and comparison, the rows where an implementation comes
    closest to its budget (what the tables take); the other rows as they are."""
    kept = ("figure", "compared", "kind", "dtype", "ops", "storage", "spread", "value", "errors",
            "ok")
    keep = []
    for i, row in enumerate(rows):
        if row["kind"] in BUDGETED and row["errors"]:
            group = [r for r in rows if (r["kind"], r["compared"]) == (row["kind"],
                                                                       row["compared"])]
            if not any(max(group, key=lambda r: ratio(r, name)) is row for name in row["errors"]):
                continue
        keep.append({k: row[k] for k in kept})
    return keep


def markdown(metas: list[dict], results: list[dict]) -> str:
    from llama_twins.parity import BUDGET, U
    from llama_twins.parity.judgement import growth
    from llama_twins.parity.planted import DESCRIPTIONS, FLOAT32_ONLY

    seconds = sum(m["seconds"] for m in metas)
    machines = sorted({f"{m['cpu']} ({', '.join(m['flags'])}), {m['isa']} path" for m in metas})
    checkpoints = {k: v for m in metas for k, v in m["checkpoints"].items()}
    lines = ["# Parity calibration", "",
             f"Generated by `scripts/parity_calibration.py` in {len(metas)} parts, "
             f"{seconds / 60:.0f} minutes in all, on: " + "; ".join(machines) + ".", "",
             "Checkpoints: " + ", ".join(f"{k} (`{v}`)" for k, v in checkpoints.items()) + ".",
             "", "## Correct implementations against their budgets", "",
             "Per figure and dtype, over every correct report (both ISA paths, every checkpoint, "
             "JAX, torch and transformers): the largest error against float64 per op (the error "
             "/ ops: the blocks behind it, or the steps or positions), in units "
             "of the dtype's unit roundoff U (learning rates for the AdamW figures, ulps for the "
             "weights), beside the budget per op, and the largest error / budget (below 1 "
             "passes) with where it was.", "",
             "| figure | dtype | largest error per op | budget per op | error / budget |",
             "|---|---|---|---|---|"]
    correct = [r for r in results if r["bug"] is None]
    for dtype in DTYPES:
        for kind in BUDGETED:
            rows = [(row, r) for r in correct if r["dtype"] == dtype for row in r["rows"]
                    if row["kind"] == kind and row["errors"]]
            if not rows:
                continue
            judged_in = rows[0][0]["dtype"]
            unit = 1.0 if kind in ("adamw", "optimizer", "weights") else U[judged_in]
            per_op = max(e / growth(kind, row["ops"] or 1) for row, _ in rows
                         for e in row["errors"].values())
            worst = max(rows, key=lambda x: ratio(x[0]))
            name = {"adamw": " lr", "optimizer": " lr", "weights": " ulp"}.get(kind, " U")
            lines.append(f"| {kind} | {dtype} | {per_op / unit:.3g}{name} | "
                         f"{BUDGET[judged_in][kind] / unit:.3g}{name} | "
                         f"{ratio(worst[0]):.2f} ({_where(worst[1], worst[0])}) |")
    false_fails = [r for r in correct if not passes(r)]
    lines += ["", "The AdamW figures' budgets add the storage term (U x max |w| / lr a step), and "
              "the trajectory's is at least 30 x the perturbed float64 runs' spread (below), so "
              "their largest error per op may exceed the budget per op and still pass.", "",
              f"False FAILs: {len(false_fails)} of {len(correct)} correct reports"
              + (": " + "; ".join(_where(r) + ": " + ", ".join(
                  row["figure"] for row in r["rows"]
                  if (ratio(row) > 1 if row["kind"] in BUDGETED and row["errors"]
                      else not row["ok"])) for r in false_fails) if false_fails else "."),
              "", "## Planted bugs: caught, named, and by which figures", "",
              "Per bug and dtype over every checkpoint and ISA path it was planted in: how many "
              "reports failed naming its twin; the block and part they named (how many times "
              "each, over the reports run with the placement by each part's own error); and, "
              "per kind of figure, the least over those reports of the planted "
              "twin's error / its budget (above 1: that figure catches it; '-': the figure did "
              "not run, as the training figures in the reports of a bug in the model). A "
              "figure's sensitivity follows: it catches a bug of the same kind down to about "
              "the bug's size / that ratio.", "",
              "| bug | dtype | caught, twin named | placed at | " + " | ".join(FAMILIES) + " |",
              "|---|---|---|---|" + "---|" * len(FAMILIES)]
    for bug, both, dtype in ((b, both, d) for b in DESCRIPTIONS for both in (False, True)
                             for d in DTYPES):
        if dtype == "bfloat16" and bug in FLOAT32_ONLY:
            continue
        runs = [r for r in results if r["bug"] == bug and r["dtype"] == dtype
                and (r["twin"] == "both") == both]
        if runs:
            named = sum(not passes(r) and culprit(r) == _named(r["twin"]) for r in runs)
            places = {}
            for r in runs:
                if r.get("placed", True):
                    place = _place(r["first_divergence"].get("torch vs JAX"))
                    places[place] = places.get(place, 0) + 1
            cells = []
            for kinds in FAMILIES.values():
                seen = [_family(r, kinds) for r in runs]
                seen = [x for x in seen if x is not None]
                cells.append(f"{min(seen):.3g}x" if seen else "-")
            lines.append(f"| {DESCRIPTIONS[bug]}{', in both twins' if both else ''} | {dtype} | "
                         f"{named} of {len(runs)} | "
                         + (", ".join(f"{p} ({n})" for p, n in sorted(places.items())) or "-")
                         + " | " + " | ".join(cells) + " |")
    return "\n".join(lines + trajectory(correct)) + "\n"


def trajectory(correct: list[dict]) -> list[str]:
    """The table of the trajectory figure (the parameters after the AdamW steps) in each correct
    report that measured the perturbed float64 runs: each twin's error, the runs' spread, the
    larger error / the spread, the fixed budget and the bound the figure was held to."""
    from llama_twins.parity import SPREAD_MULTIPLE, budget

    rows = [(r, row) for r in correct for row in r["rows"]
            if row["kind"] == "adamw" and row["errors"] and row.get("spread")]
    if not rows:
        return []
    lines = ["", "## The training trajectory against the perturbed float64 runs", "",
             "Per correct report: the parameters after the AdamW steps, each twin's error against "
             "the plain float64 run and the spread of the perturbed float64 runs (the larger of "
             "the two; rounding-sized noise in each step's gradients and the weights rounded to "
             "the dtype, grown by the model over the same steps), in learning rates; the larger "
             "error / the spread; the fixed budget (BUDGET x steps + storage); the bound, the "
             f"larger of the fixed budget and {SPREAD_MULTIPLE:g} x the spread; and the larger "
             "error / the bound (below 1 passes).", "",
             "| report | JAX | torch | spread | error / spread | fixed budget | bound | "
             "error / bound |", "|---|---|---|---|---|---|---|---|"]
    for r, row in sorted(rows, key=lambda x: -max(x[1]["errors"].values()) / x[1]["spread"]):
        worst = max(row["errors"].values())
        fixed = budget(row["dtype"], row["kind"], row["ops"] or 1, row["storage"] or 0.0)
        bound = budget(row["dtype"], row["kind"], row["ops"] or 1, row["storage"] or 0.0,
                       row["spread"])
        e = row["errors"]
        lines.append(f"| {_where(r)} | {e.get('JAX', 0):.3g} | {e.get('torch', 0):.3g} | "
                     f"{row['spread']:.3g} | {worst / row['spread']:.2f} | {fixed:.3g} | "
                     f"{bound:.3g} | {worst / bound:.2f} |")
    return lines


def _named(twin: str) -> str:
    """The culprit a report names for a bug planted in `twin`."""
    return "JAX and torch" if twin == "both" else twin


def _where(r: dict, row: dict | None = None) -> str:
    text = f"{r['checkpoint']} {r['dtype']} {r['isa']}"
    if r.get("training_lr"):
        text += f" at training lr {r['training_lr']:g}"
    if r.get("reference"):
        text += f" with {r['reference']}"
    return text + (f", {row['figure']}, {row['compared']}" if row is not None else "")


def _place(where: dict | None) -> str:
    return "-" if where is None else f"block {where['block']} {where['sublayer']}"


# The kinds of figure the bug table has a column for.
FAMILIES = {"weights": ("weights",), "forward (hidden, logits)": ("hidden", "logits"),
            "RoPE": ("rope",), "RMSNorm": ("norm",),
            "training (loss, gradients, AdamW)": ("loss", "grad_norm", "grad", "adamw"),
            "optimizer": ("optimizer",)}


def _family(result: dict, kinds) -> float | None:
    """The planted twin's largest error / budget over a report's figures of `kinds` (None when
    it has none)."""
    seen = [ratio(row, result["twin"]) for row in result["rows"]
            if row["kind"] in kinds and row["errors"]]
    return max(seen) if seen else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="*", help="NAME=PATH")
    parser.add_argument("--part", default="1/1",
                        help="I/K: the I-th of K slices of the jobs, in order (a checkpoint's "
                             "reports together, so that they share its float64 run)")
    parser.add_argument("--isa", choices=("native", "avx2"), default="native")
    parser.add_argument("--bugs", default=None,
                        help="comma-separated bugs to plant (default: all; 'none': only the "
                             "correct reports)")
    parser.add_argument("--no-correct", dest="correct", action="store_false",
                        help="only the reports with a planted bug")
    parser.add_argument("--both", action="store_true",
                        help="plant each bug in both twins at once (default: in one, "
                             "alternating)")
    parser.add_argument("--training-lr", type=float, default=None,
                        help="the training figures' peak learning rate (default: the report's, "
                             "3e-3); a larger one turns the trajectory chaotic, where the bound "
                             "follows the perturbed float64 runs' spread")
    parser.add_argument("--dtypes", default=",".join(DTYPES),
                        help="comma-separated dtypes of the reports (default: both)")
    parser.add_argument("--table", action="store_true",
                        help="gather the parts written so far into parity.json and parity.md")
    parser.add_argument("--out", default="results/parity")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.table:
        print(table(out))
        return 0
    if args.isa == "avx2":  # before JAX and torch are imported
        from llama_twins.bench.common import AVX2_ENV

        os.environ.update(AVX2_ENV)
    part, parts = (int(x) for x in args.part.split("/"))
    checkpoints = dict(item.split("=", 1) for item in args.checkpoints)
    bugs = None if args.bugs is None else [b for b in args.bugs.split(",") if b != "none"]
    dtypes = tuple(args.dtypes.split(","))
    if not set(dtypes) <= set(DTYPES):
        parser.error(f"--dtypes: expected some of {', '.join(DTYPES)}, got {args.dtypes!r}")
    print(run_part(checkpoints, part, parts, args.isa, out, bugs, args.correct, args.both,
                   args.training_lr, dtypes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
