"""gpu_bench.py's profiles (--only profile): a JAX profiler trace summarised per decode step,
and the summaries, a trace and the decode program's HLO packed for the trip back."""

from __future__ import annotations

import json
from pathlib import Path


def summarise_trace(folder: Path, steps: int) -> dict:
    """The GPU's side of a profile (jax.profiler.trace): for each line of each device plane
    (streams of kernels, XLA's ops and modules), its events, their busy time and the 30 names
    that took most, and per decode step the kernels launched, their busy time and the span of
    the decode program. Written beside the trace as summary.json."""
    from jax.profiler import ProfileData
    found = sorted(folder.rglob("*.xplane.pb"))
    if not found:
        return {"error": f"no trace under {folder}"}
    data = ProfileData.from_file(str(found[-1]))
    lines, per_step = {}, {}
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            events = list(line.events)
            if not events:
                continue
            by_name = {}
            for e in events:
                n, t = by_name.get(e.name, (0, 0.0))
                by_name[e.name] = (n + 1, t + e.duration_ns)
            busy = sum(e.duration_ns for e in events)
            span = max(e.start_ns + e.duration_ns for e in events) - min(e.start_ns for e in events)
            top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:30]
            lines[f"{plane.name} | {line.name}"] = {
                "events": len(events), "busy_us": busy / 1e3, "span_us": span / 1e3,
                "top": [[name, n, t / 1e3] for name, (n, t) in top],
                "stats_of_first": {str(k): str(v)[:80] for k, v in list(events[0].stats)[:8]}}
            if line.name.startswith("Stream"):
                per_step[line.name] = {"kernels": len(events) / steps,
                                       "busy_us": busy / 1e3 / steps}
            if "Modules" in line.name:
                for e in events:
                    if "decode" in e.name:
                        per_step[f"module {e.name}"] = {"span_us": e.duration_ns / 1e3 / steps}
    summary = {"per_step": per_step, "lines": lines, "trace": str(found[-1])}
    (folder / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def pack_profiles(path: Path, limit: int = 15 * 2**20) -> None:
    """The profiles' summaries, the first one's trace and the decode program's HLO dump in one
    .tgz (the trace left out where it would take it past `limit` bytes)."""
    import tarfile
    root = Path("/tmp/gpu-profile")
    if not root.is_dir():
        return
    for keep_traces in (True, False):
        with tarfile.open(path, "w:gz") as tar:
            for f in sorted(root.rglob("*")):
                top = f.parts[len(root.parts)]
                trace = f.name.endswith(".xplane.pb")
                wanted = (f.is_file() and not f.name.endswith(".trace.json.gz")  # the same again
                          and (top != "hlo" or "decode" in str(f))
                          and (not trace or keep_traces and top == "0"))
                if wanted:
                    tar.add(f, arcname=str(f.relative_to(root)))
        if path.stat().st_size <= limit:
            return


if __name__ == "__main__":
    import sys
    if len(sys.argv) != 3:
        sys.exit("usage: python scripts/gpu_profile.py TRACE_DIR STEPS")
    summary = summarise_trace(Path(sys.argv[1]), int(sys.argv[2]))
    if "error" in summary:
        print(f"gpu_profile: {summary['error']}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(summary["per_step"], indent=1))
