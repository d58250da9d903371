"""One worker process of the benchmarks; prints one JSON line.

    python -m llama_twins.bench.worker JOB --spec JSON [--benches forward,train,decode] [--depths 4,32]

JOB is an implementation (jax-llama, torch_llama, transformers, or llama.cpp for decode and llama-bench: it runs each bench's
measure(impl, spec) in turn, in this one process), `machine` (the CPU, JAX's device and versions,
and this machine's matmul peak and read bandwidth measured through JAX), `compile` (train-step
compile times at two depths), `lora` and `lora-full` (llama_twins.bench.lora: the LoRA step's
memory and time; XLA's plan for full fine-tuning) or `probe` (torch's device and version, and
transformers' version or why it does not import). Started by llama_twins.bench.common.spawn, never by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

from . import decode, forward, llama_bench, long, lora, train
from .common import IMPLEMENTATIONS, LLAMA_CPP, Spec, cpu_model

MEASURE = {"forward": forward.measure, "train": train.measure,
           "train-lora": train.measure_lora, "decode": decode.measure,
           llama_bench.BENCH: llama_bench.measure}


def machine(spec: Spec) -> dict:
    import flax
    import jax
    import jaxlib
    import numpy as np

    from jax_llama.perf import measure_matmul_peak, measure_read_bandwidth
    device, n = jax.devices()[0], jax.device_count()
    kind = (device.platform if device.device_kind == device.platform
            else f"{device.platform} ({device.device_kind})")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu_model(), "cores": cores, "os": f"{platform.system()} {platform.machine()}",
            "jax_device": kind + (f" x {n}" if n > 1 else ""),
            "python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "flax": flax.__version__, "numpy": np.__version__,
            "peak_dtype": spec.dtype, "peak_flops": measure_matmul_peak(spec.dtype),
            "read_bandwidth": measure_read_bandwidth()}


def probe() -> dict:
    import torch
    device = (f"cuda ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else "cpu")
    info = {"torch": torch.__version__, "torch_device": device, "torch_threads": torch.get_num_threads()}
    try:
        import transformers
        info.update(transformers=transformers.__version__, transformers_error=None)
    except ImportError as e:  # what `jax-llama bench` reports, and then runs our side only
        info.update(transformers=None, transformers_error=f"{type(e).__name__}: {e}")
    from importlib.metadata import PackageNotFoundError, version
    try:  # transformers' int8 path in the decode bench (torchao's weight-only quantisation)
        info.update(torchao=version("torchao"))
    except PackageNotFoundError:
        info.update(torchao=None)
    from llama_twins.llama_cpp_reference import build_features, repacks_safely, unavailable
    info.update(llama_cpp=unavailable())  # None where llama-cpp-python runs: the decode rows
    if info["llama_cpp"] is None:  # what its rows ran: the build's features, repacked or not
        info.update(llama_cpp_build=build_features(), llama_cpp_repacks=repacks_safely())
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("job", choices=(*IMPLEMENTATIONS, LLAMA_CPP, "machine", "compile", "probe",
                                        "long", *lora.JOBS))
    parser.add_argument("--spec", required=True, help="a Spec as JSON")
    parser.add_argument("--benches", default="",
                        help="comma-separated: forward, train, train-lora, decode")
    parser.add_argument("--depths", default="4,32", help="compile: shallow,deep layer counts")
    parser.add_argument("--variant", help="long: the implementation and attention, e.g. "
                                          "'jax-llama chunked'; lora: how the step is compiled")
    args = parser.parse_args(argv)
    spec = Spec.from_json(args.spec)
    if args.job == "machine":
        result = machine(spec)
    elif args.job == "probe":
        result = probe()
    elif args.job == "long":
        result = long.measure(args.variant, spec)
    elif args.job in lora.JOBS:
        result = lora.JOBS[args.job](spec, *([args.variant] if args.variant else []))
    elif args.job == "compile":
        shallow, deep = map(int, args.depths.split(","))
        result = train.compile_times(spec, (shallow, deep))
    else:
        result = {bench: MEASURE[bench](args.job, spec) for bench in args.benches.split(",") if bench}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
