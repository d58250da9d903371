"""Is checkpoint B still checkpoint A? `llama-bridge compare A B` (issue 80).

The sections that read the checkpoints alone live in bridge.compare: the config, the tokenizer,
the chat template and the weights. The two that run the models live here: the outputs on real
text (outputs.py: KL divergence, same top-1 and perplexity, as llama.cpp's llama-perplexity
reports them) and, when those differ beyond what the storage types explain, the block and
sub-layer where the models part (blocks.py).

    verdict, findings = compare("model-hf", "model.Q8_0.gguf")

The text is DEFAULT_TEXT (an essay shipped with the package, a few thousand tokens) unless one
is given.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Callable

from bridge.compare.report import DIFFERENT, SAME, SKIPPED, WITHIN, Finding, verdict
from bridge.errors import BridgeError
from bridge.formats import open_checkpoint

from .blocks import where_they_part
from .outputs import compare_outputs

DEFAULT_TEXT = Path(__file__).with_name("default_text.txt")

# The sections that read the checkpoints, in the order they run: (section, module, function).
READ_SECTIONS = (("config", "config", "compare_config"),
                 ("tokenizer", "tokenizer", "compare_tokenizers"),
                 ("template", "template", "compare_templates"),
                 ("weights", "weights", "compare_weights"))


def default_text() -> str:
    """The embedded text, less its header line (which says where it comes from)."""
    return DEFAULT_TEXT.read_text(encoding="utf-8").split("\n", 1)[1].strip()


def _section(name: str, module: str, function: str):
    """bridge.compare.<module>.<function>, or None where that section is not built."""
    try:
        return getattr(importlib.import_module(f"bridge.compare.{module}"), function)
    except (ImportError, AttributeError):
        return None


class WithAdapter:
    """An opened checkpoint as the read sections see it with a LoRA adapter merged: each tensor
    the adapter trains comes merged (bridge.lora: what `merge-lora` writes and jax_llama.load
    with adapter= runs), as a float tensor; everything else is the checkpoint's."""

    def __init__(self, ckpt, adapter):
        from bridge.lora import read_peft

        self._ckpt, self._lora = ckpt, read_peft(adapter, ckpt.config)

    def __getattr__(self, name):
        return getattr(self._ckpt, name)

    def _trains(self, name: str) -> bool:
        lora = self._lora.tensors
        return name.replace(".weight", ".lora_A.weight") in lora or name in lora

    def tensor(self, name: str):
        return self._lora.merged(name, self._ckpt.tensor(name))

    def adapter_update(self, name: str):
        """(A's own tensor, the adapter's update of it) for a tensor the adapter trains, else
        None: what the weights section measures a merge against (bridge.compare.patterns)."""
        if not self._trains(name):
            return None
        base = self._ckpt.tensor(name)
        return base, self._lora.merged(name, base) - base

    def tensor_slice(self, name: str, index):
        return self.tensor(name)[index].copy()

    def stored_type(self, name: str):
        return None if self._trains(name) else self._ckpt.stored_type(name)

    def int4_tensor(self, name: str):
        return None if self._trains(name) else self._ckpt.int4_tensor(name)

    def int4_rounded(self, name: str):
        return None if self._trains(name) else self._ckpt.int4_rounded(name)


def compare(a: str, b: str, adapter: str | None = None, text: str | None = None,
            progress: Callable[[str], object] | None = None) -> tuple[str, list[Finding]]:
    """(verdict, findings) of B against A (paths or model names; `adapter` a PEFT directory
    applied to A): each section's Finding in order, the outputs on `text` (default_text() when
    None), and where the models part when the outputs differ. The verdict is
    bridge.compare.report.verdict's."""
    heard = progress or (lambda message: None)
    ckpt_a, ckpt_b = open_checkpoint(a), open_checkpoint(b)
    text = default_text() if text is None else text
    if not text.strip():
        raise BridgeError("the text to compare on is empty", field="text")
    read_a = ckpt_a if adapter is None else WithAdapter(ckpt_a, adapter)
    findings = []
    for name, module, function in READ_SECTIONS:
        section = _section(name, module, function)
        heard(f"{name}: comparing")
        if section is None:
            findings.append(Finding(name, SKIPPED, "not built"))
        elif name == "tokenizer":
            findings.append(section(read_a, ckpt_b, text))
        elif name == "weights":
            findings.append(section(read_a, ckpt_b, progress=None if progress is None else (
                lambda i, n: heard(f"weights: {i} of {n} tensors")
                if i % 50 == 0 or i == n else None)))
        else:
            findings.append(section(read_a, ckpt_b))
    outputs = compare_outputs(ckpt_a, ckpt_b, text, adapter=adapter, progress=progress)
    findings.append(outputs)
    if outputs.verdict == DIFFERENT:
        from bridge.tokenizer import find_tokenizer

        tokenizer = find_tokenizer(ckpt_a)
        tokens = tokenizer.encode(text, bos=tokenizer.add_bos)
        findings.append(where_they_part(ckpt_a, ckpt_b, tokens, adapter=adapter,
                                        progress=progress))
    return verdict(findings)[0], findings


def end_line(result: str, findings: list[Finding]) -> str:
    """The report's last line: "same", "same within quantisation (the figures beside the type's
    reference)" or "different: CAUSE; check next: ...". Where the outputs and the block where
    the models part both differ, the block is named as the cause: it says where to look."""
    if result == SAME:
        return "same"
    if result == WITHIN:
        within = [f for f in findings if f.verdict == WITHIN]
        return f"{WITHIN} ({'; '.join(f'{f.section}: {f.summary}' for f in within)})"
    first = next(f for f in findings if f.verdict == DIFFERENT)
    if first.section == "outputs":
        first = next((f for f in findings if f.section == "blocks" and f.verdict == DIFFERENT),
                     first)
    return f"different: {first.cause or first.summary}; check next: {first.check_next or '-'}"


def format_report(result: str, findings: list[Finding]) -> str:
    """The text report: one block per section (its verdict, summary and lines), then end_line."""
    out = []
    for f in findings:
        out.append(f"{f.section}: {f.verdict.upper()} - {f.summary}")
        out += [f"  {line}" for line in f.lines]
    out.append(end_line(result, findings))
    return "\n".join(out)


__all__ = ["DEFAULT_TEXT", "compare", "compare_outputs", "default_text", "end_line",
           "format_report", "where_they_part"]
