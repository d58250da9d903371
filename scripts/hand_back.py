"""Hand a (fine-tuned) checkpoint back: exported `--to hf`, transformers loads it (AutoTokenizer
and AutoModelForCausalLM) with our logits and our greedy chat answers; exported `--to gguf`,
llama.cpp (llama-cpp-python, where installed) gives our greedy chat answers. Writes
results/formats/hand_back.{json,md}.

    python scripts/hand_back.py CHECKPOINT [--out results/formats] [--new-tokens 24]

CHECKPOINT: any checkpoint the bridge reads with its tokenizer and chat template beside it, e.g.
a `finetune --init SmolLM2` run's model/ (the backbone; the classifier head files are not part of
a language model and stay behind).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from llama_twins import results
from llama_twins.bench.common import cpu_model

QUESTIONS = ["What is the capital of France?", "Name three primary colours.",
             "Write a haiku about the sea."]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--out", default="results/formats")
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    import torch
    import transformers

    import jax_llama
    from bridge.chat import find_template
    from bridge.convert import convert
    from tasks.prompts import encode_prompts, stop_ids
    from bridge.tokenizer import find_tokenizer

    tokenizer = find_tokenizer(args.checkpoint)
    prompts = encode_prompts(tokenizer, QUESTIONS, 8192,
                             chat=find_template(args.checkpoint, tokenizer))
    stops = stop_ids(tokenizer)
    model, params = jax_llama.load(args.checkpoint)
    ours = jax_llama.generate(model, params, prompts, args.new_tokens, stop_ids=stops).tokens
    result = {"checkpoint": args.checkpoint, "cpu": cpu_model(), "cores": os.cpu_count(),
              "answers": {"jax-llama": [tokenizer.decode(a) for a in ours]}}
    with tempfile.TemporaryDirectory(prefix="hand-back-") as tmp:
        hf_dir = convert(args.checkpoint, Path(tmp) / "hf", "hf", progress=False)
        tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        chats = [tok.apply_chat_template([{"role": "user", "content": q}],
                                         add_generation_prompt=True, return_dict=True)["input_ids"]
                 for q in QUESTIONS]
        worst = 0.0
        hf_answers = []
        for prompt, chat, answer in zip(prompts, chats, ours):
            ids = np.array([prompt + answer], np.int32)
            mine = np.asarray(model.apply({"params": params}, ids))[0]
            with torch.inference_mode():
                theirs = hf(input_ids=torch.as_tensor(ids, dtype=torch.long)).logits[0].numpy()
            worst = max(worst, float(np.abs(mine - theirs).max()))
            out = hf.generate(torch.as_tensor([chat]), max_new_tokens=args.new_tokens,
                              do_sample=False, eos_token_id=list(stops),
                              pad_token_id=tokenizer.eos_id)
            hf_answers.append(out[0, len(chat):].tolist())
        result["transformers"] = {
            "tokenizer_and_template_equal": chats == prompts,
            "max_abs_logit_difference": worst,
            "greedy_equal": [list(a) == list(b) for a, b in zip(ours, hf_answers)]}
        result["answers"]["transformers"] = [tok.decode(a) for a in hf_answers]
        try:
            from llama_twins import llama_cpp_reference
            reason = llama_cpp_reference.unavailable()
        except ImportError as e:
            reason = str(e)
        if reason is None:
            _, greedy = llama_cpp_reference.run(args.checkpoint, "float32", prompts,
                                                args.new_tokens)
            # llama.cpp does not stop by itself here: cut at our stop ids as generate does
            cut = [g[:next((i + 1 for i, t in enumerate(g) if t in stops), len(g))]
                   for g in greedy]
            result["llama.cpp"] = {"greedy_equal": [list(a) == c for a, c in zip(ours, cut)]}
            result["answers"]["llama.cpp"] = [tokenizer.decode(c) for c in cut]
        else:
            result["llama.cpp"] = {"skipped": reason}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hf_row = result["transformers"]
    lines = [f"# Handing {args.checkpoint} back", "",
             f"{result['cpu']}, {result['cores']} cores; `python scripts/hand_back.py "
             f"{args.checkpoint}`. Greedy chat answers, {args.new_tokens} new tokens at most.", "",
             f"- `--to hf`: AutoTokenizer's chat template gives our prompt ids: "
             f"{hf_row['tokenizer_and_template_equal']}; largest logit difference over the "
             f"prompts and answers {hf_row['max_abs_logit_difference']:.2e}; greedy answers "
             f"equal: {hf_row['greedy_equal']}",
             f"- `--to gguf` in llama.cpp: greedy answers equal: "
             f"{result['llama.cpp'].get('greedy_equal', result['llama.cpp'].get('skipped'))}",
             "", "| question | " + " | ".join(result["answers"]) + " |",
             "|---|" + "---|" * len(result["answers"])]
    for i, q in enumerate(QUESTIONS):
        lines.append(f"| {q} | " + " | ".join(repr(a[i]) for a in result["answers"].values())
                     + " |")
    print(results.write("hand_back", result, lines, out), end="")
    ok = (hf_row["tokenizer_and_template_equal"] and all(hf_row["greedy_equal"])
          and all(result["llama.cpp"].get("greedy_equal", [True])))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
