"""What a training run loses to what real machines do, measured through the command line as a user
meets it: a SIGTERM mid-run (the seconds from the signal to the exit, the steps lost, the resumed
model against an uninterrupted one), a damaged newest checkpoint, a full disk under the
checkpoints, and - with a real model - how long a preemption notice must be for a SmolLM2 run to
stop cleanly. Writes results/reliability/reliability.{json,md}.

    python scripts/reliability.py [--gguf SmolLM2-135M-Instruct.Q4_1.gguf] [--work runs/reliability]

The full-disk row mounts a small tmpfs, so it needs root (it is left out otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llama_twins import results
from llama_twins.bench.common import cpu_model

TINY = ["--steps", "200", "--checkpoint-every", "50", "--eval-every", "100", "--sample-tokens", "0"]


def jax_llama(*args, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "llama_twins.cli.main", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    _, err = proc.communicate(timeout=3600)
    if proc.returncode not in (0, 2):
        sys.exit(f"failed ({proc.returncode}): {err[-3000:]}")
    return proc.returncode, err


def last_line(err: str, pattern: str) -> str:
    return next(line for line in reversed(err.splitlines()) if re.search(pattern, line))


def model_bytes(run: Path) -> bytes:
    return (run / "model" / "model.safetensors").read_bytes()


def resumed_at(err: str) -> int:
    return int(re.search(r"resumed .* at step (\d+)", err).group(1))


def stop_on_sigterm(command: list, run: Path, when) -> dict:
    """Run `command`, send SIGTERM once when(run) is true, and time the stop."""
    proc = jax_llama(*command, "--out", run)
    while not when(run) and proc.poll() is None:
        time.sleep(0.05)
    sent = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc)
    seconds = time.perf_counter() - sent
    line = last_line(err, "stopped at step")
    step = int(re.search(r"stopped at step (\d+)", line).group(1))
    ckpt = run / "checkpoints" / str(step)
    return {"exit": code, "seconds_to_exit": round(seconds, 2), "stopped_at": step, "line": line,
            "checkpoint_bytes": tree_bytes(ckpt)}


def steps_done(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def tiny_rows(work: Path) -> dict:
    rows = {}
    straight = work / "straight"
    finish(jax_llama("train", *TINY, "--out", straight))
    run = work / "sigterm"
    row = stop_on_sigterm(["train", *TINY], run, lambda r: steps_done(r) >= 70)
    code, err = finish(jax_llama("train", "--out", run, "--resume"))
    row.update(steps_lost=row["stopped_at"] - resumed_at(err),
               bitwise_equal=model_bytes(run) == model_bytes(straight))
    rows["sigterm"] = row

    # the newest checkpoint damaged: one byte flipped in its largest file
    newest = max((p for p in (run / "checkpoints").iterdir() if p.name.isdigit()),
                 key=lambda p: int(p.name))
    target = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    shutil.rmtree(run / "model")
    code, err = finish(jax_llama("train", "--out", run, "--resume"))
    back = resumed_at(err)
    rows["damaged"] = {"line": last_line(err, "set aside as"), "newest": int(newest.name),
                       "resumed_at": back, "steps_run_again": int(newest.name) - back,
                       "bitwise_equal": model_bytes(run) == model_bytes(straight)}
    return rows


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def full_disk_row(work: Path) -> dict | None:
    """The same run on a tmpfs with room for its tokens, its tokenizer and one and a half
    checkpoints (sized from the straight run): the first checkpoint fits, the second does not."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return None
    straight = work / "straight"
    size = (tree_bytes(work / "token-cache") + tree_bytes(straight / "tokenizer")
            + 3 * tree_bytes(straight / "checkpoints" / "200") // 2 + (256 << 10))
    mount = Path(tempfile.mkdtemp(dir=work, prefix="small-fs-"))
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size // 1024}k", "tmpfs",
                       str(mount)]).returncode:
        return None
    try:
        run = mount / "run"
        code, err = finish(jax_llama("train", *TINY, "--out", run))
        left = sorted(p.name for p in (run / "checkpoints").iterdir())
        return {"exit": code, "line": err.strip().splitlines()[-1], "checkpoints_left": left,
                "bytes_left_in_checkpoints": tree_bytes(run / "checkpoints"),
                "disk_bytes": size}
    finally:
        subprocess.run(["umount", "--lazy", str(mount)])


def smollm2_row(gguf: str, work: Path) -> dict:
    """A full-weight run from SmolLM2: the whole state (params + AdamW's two moments, float32)
    is what the checkpoint written on SIGTERM holds."""
    command = ["train", "--init", gguf, "--steps", "40", "--batch-size", "4", "--seq-len", "128",
               "--checkpoint-every", "1000", "--eval-every", "1000", "--sample-tokens", "0"]
    run = work / "smollm2"
    row = stop_on_sigterm(command, run, lambda r: steps_done(r) >= 3)
    started = time.perf_counter()
    proc = jax_llama("train", "--out", run, "--resume", "--steps", "40")
    while steps_done(run) <= row["stopped_at"] and proc.poll() is None:
        time.sleep(0.05)
    row["seconds_to_first_step_after_resume"] = round(time.perf_counter() - started, 1)
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc)
    row["steps_lost"] = row["stopped_at"] - resumed_at(err)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", help="SmolLM2's GGUF (the row is left out without it)")
    parser.add_argument("--work", default="runs/reliability")
    parser.add_argument("--out", default="results/reliability")
    args = parser.parse_args(argv)
    work = Path(args.work)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    result = {"cpu": cpu_model(), "cores": os.cpu_count(), **tiny_rows(work)}
    result["full_disk"] = full_disk_row(work)
    if args.gguf:
        result["smollm2"] = smollm2_row(args.gguf, work)
    out = Path(args.out)
    # paths as seen from the directory the script ran in
    result = json.loads(json.dumps(result).replace(str(Path.cwd()) + os.sep, ""))
    s, d = result["sigterm"], result["damaged"]
    lines = ["# What a run loses: signals, damaged checkpoints, a full disk", "",
             f"{result['cpu']}, {result['cores']} cores; `python scripts/reliability.py"
             f"{' --gguf <SmolLM2 .gguf>' if args.gguf else ''}`. The tiny rows run "
             f"`jax-llama train {' '.join(TINY)}` on the embedded corpus.", "",
             "| event | what the run did | steps lost | against an uninterrupted run |",
             "|---|---|---|---|",
             f"| SIGTERM after step ~70 | exit {s['exit']} {s['seconds_to_exit']} s after the "
             f"signal, at step {s['stopped_at']}; checkpoint {s['checkpoint_bytes']:,} bytes | "
             f"{s['steps_lost']} | model bitwise equal: {s['bitwise_equal']} |",
             f"| checkpoint {d['newest']} damaged (one byte flipped) | set aside; resumed at step "
             f"{d['resumed_at']} | {d['steps_run_again']} run again | model bitwise equal: "
             f"{d['bitwise_equal']} |"]
    if result["full_disk"]:
        f = result["full_disk"]
        lines.append(f"| a {f['disk_bytes'] / 2**20:.1f} MiB disk under the run (room for 1.5 "
                     f"checkpoints) | exit {f['exit']}; checkpoints left: "
                     f"{', '.join(f['checkpoints_left']) or 'none'} | - | bytes of the failed "
                     f"checkpoint left behind: 0 (checkpoints/ holds "
                     f"{f['bytes_left_in_checkpoints']:,} bytes in all) |")
    if args.gguf:
        m = result["smollm2"]
        lines.append(f"| SIGTERM during a full-weight SmolLM2 run (`train --init`, batch 4 x 128) "
                     f"| exit {m['exit']} {m['seconds_to_exit']} s after the signal (the step "
                     f"under way, then a {m['checkpoint_bytes'] / 1e9:.2f} GB checkpoint); the "
                     f"resumed run's first step {m['seconds_to_first_step_after_resume']} s after "
                     f"its start | {m['steps_lost']} | - |")
    lines += ["", "The lines the runs printed:", ""]
    here = str(Path.cwd()) + os.sep  # no machine-local paths in the results
    lines += [f"- {what}: `{row['line'].replace(here, '')}`" for what, row in
              (("SIGTERM", s), ("damaged", d), ("full disk", result["full_disk"]),
               ("SmolLM2", result.get("smollm2"))) if row]
    print(results.write("reliability", result, lines, out), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
