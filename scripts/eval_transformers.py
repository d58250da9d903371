"""The reference for `jax-llama eval` / `torch-llama eval`: the same sliding-window perplexity
computed with Hugging Face transformers, line for line as its guide "Perplexity of fixed-length
models" does it, on a checkpoint in Hugging Face format (`llama-bridge convert CKPT DIR --to hf`).

    python scripts/eval_transformers.py HF_DIR --data FILE|DIR... --seq-len 128 --stride 64 [--json]

Each document is tokenised with the checkpoint's own tokenizer as transformers loads it
(AutoTokenizer: BOS first where the tokenizer adds one, as the HF export's post-processor does);
the ids are checked against bridge's tokenizer on the same directory, so both sides score the
same tokens. One window at a time (batch 1), labels -100 on the context tokens, transformers'
own loss. Prints the same keys as `jax-llama eval --json`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch


def guide_nll(model, ids: torch.Tensor, seq_len: int, stride: int) -> tuple[float, int]:
    """(total NLL in nats, scored tokens) of one document `ids` (1, n), as transformers' guide
    computes it: windows of seq_len tokens every stride tokens; in each, the labels of the tokens
    an earlier window scored are -100 (context); the model shifts labels inside, so a window's
    first token is never a target. The loss is a mean over the targets, so it is multiplied back
    by their number (the labels after the shift that are not -100)."""
    n = ids.size(1)
    nll, n_tokens, previous_end = 0.0, 0, 0
    for begin in range(0, n, stride):
        end = min(begin + seq_len, n)
        target_len = end - previous_end  # may differ from stride in the last window
        input_ids = ids[:, begin:end]
        labels = input_ids.clone()
        labels[:, :-target_len] = -100
        n_targets = int((labels[:, 1:] != -100).sum())
        if n_targets:
            with torch.no_grad():
                loss = model(input_ids, labels=labels).loss
            nll += float(loss) * n_targets
            n_tokens += n_targets
        previous_end = end
        if end == n:
            break
    return nll, n_tokens


def main(argv=None) -> int:
    from transformers import AutoTokenizer, LlamaForCausalLM

    from tasks.evaluation import read_texts
    from bridge.tokenizer import find_tokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", metavar="HF_DIR")
    p.add_argument("--data", nargs="+", required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--stride", type=int, required=True)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    texts = read_texts(args.data)
    hf_tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    ours = find_tokenizer(args.checkpoint)
    model = LlamaForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    files: dict[str, list] = {}
    for t in texts:
        ids = hf_tokenizer(t.text, return_tensors="pt").input_ids
        if ids[0].tolist() != ours.encode(t.text, bos=ours.add_bos):
            print(f"error: {t.where}: transformers' tokenizer gives other ids than bridge's",
                  file=sys.stderr)
            return 1
        started = time.perf_counter()
        nll, n_tokens = guide_nll(model, ids, args.seq_len, args.stride)
        acc = files.setdefault(t.path, [0.0, 0, 0, 0.0])
        for k, v in enumerate((nll, n_tokens, t.n_bytes, time.perf_counter() - started)):
            acc[k] += v

    def figures(nll, n_tokens, n_bytes, seconds):
        return {"nll_per_token": nll / n_tokens, "perplexity": math.exp(nll / n_tokens),
                "tokens": n_tokens, "bits_per_byte": nll / math.log(2) / n_bytes,
                "bytes": n_bytes, "nll": nll, "seconds": seconds}
    total = [sum(acc[k] for acc in files.values()) for k in range(4)]
    report = {"checkpoint": args.checkpoint, "seq_len": args.seq_len, "stride": args.stride,
              "batch_size": 1, **figures(*total),
              "files": {path: figures(*acc) for path, acc in files.items()}}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"transformers: {report['tokens']:,} tokens, "
              f"nll/token {report['nll_per_token']:.4f}, "
              f"perplexity {report['perplexity']:.3f}, bits/byte {report['bits_per_byte']:.4f}, "
              f"{report['seconds']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
