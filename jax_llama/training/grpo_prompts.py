"""GRPO's prompts (jax_llama.training.grpo): read from TRL's JSONL format, or the arithmetic demo
task, and encoded - a message list rendered with the chat template - each checked to leave room
for the completion in the model's context."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bridge.errors import BridgeError


# -- prompts: the data, or the demo task ----------------------------------------------------------

@dataclass
class Prompt:
    where: str          # FILE:LINE, or demo:N
    prompt: object      # as the data gave it: a string or a list of messages
    ids: list[int]      # rendered and encoded, ending where the completion starts
    columns: dict       # every other column of the line


def demo_prompts(n: int, seed: int) -> list[tuple[str, dict]]:
    """`n` arithmetic questions, "What is A + B? Answer with the number only." over two-digit
    A and B, with their answers: a task whose answer a program checks and that a small instruct
    model can do but does not answer tersely (SmolLM2-135M-Instruct starts explaining)."""
    rng = np.random.default_rng([seed, 29])
    records = []
    for i in range(n):
        a, b = (int(x) for x in rng.integers(10, 100, 2))
        records.append((f"demo:{i + 1}", {
            "prompt": [{"role": "user",
                        "content": f"What is {a} + {b}? Answer with the number only."}],
            "answer": str(a + b)}))
    return records


def read_prompts(path: str) -> list[tuple[str, dict]]:
    """[(FILE:LINE, record)] of a prompts JSONL (TRL's format: "prompt", a string or a list of
    messages; every other column goes to the reward functions); anything else refused naming
    FILE:LINE."""
    from tasks.chats import read_json_lines
    from tasks.preference import _check_messages

    records = []
    for where, obj in read_json_lines(path, "prompts"):
        if not isinstance(obj, dict):
            raise BridgeError(f"{where}: expected a JSON object (got {type(obj).__name__})")
        if "prompt" not in obj:
            raise BridgeError(f"{where}: no \"prompt\" (got keys "
                              f"{', '.join(map(repr, obj)) or 'none'})")
        prompt = obj["prompt"]
        if isinstance(prompt, list):
            obj = {**obj, "prompt": _check_messages(prompt, where, "prompt")}
        elif not isinstance(prompt, str) or not prompt:
            raise BridgeError(f"{where}: prompt: expected a non-empty string or a list of "
                              f"messages (got {type(prompt).__name__})")
        records.append((where, obj))
    if not records:
        raise BridgeError(f"{path}: no prompts (the file is empty)")
    return records


def encode_prompts(records, tokenizer, template, context: int, completion: int) -> list[Prompt]:
    """Each record's prompt as ids (a string as the tokenizer encodes it, a message list
    rendered with the chat template and its generation prompt); a prompt that leaves no room
    for max_completion_length tokens in the model's context refused naming FILE:LINE."""
    prompts = []
    for where, record in records:
        prompt = record["prompt"]
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt, bos=tokenizer.add_bos)
        else:
            if template is None:
                raise BridgeError(f"{where}: a conversational prompt needs a chat template "
                                  f"(--chat-template)")
            ids = template.encode(prompt, tokenizer, add_generation_prompt=True)
        if len(ids) + completion > context:
            raise BridgeError(f"{where}: the prompt's {len(ids)} tokens and "
                              f"max_completion_length {completion} exceed the model's context "
                              f"({context} tokens)")
        prompts.append(Prompt(where, prompt, list(ids),
                              {k: v for k, v in record.items() if k != "prompt"}))
    return prompts
