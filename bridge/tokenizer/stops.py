"""The tokens llama.cpp knows by name: those that end a generation, and the fill-in-the-middle
ones. Every tokenizer kind takes its stop ids by this rule (Llama2Tokenizer, HFTokenizer), so that a
GGUF vocabulary (bridge.gguf.tokenizer) and the tokenizer file it came from stop at the same ids.
"""

from __future__ import annotations

from typing import Iterable

# llama-cpp-python 0.3.36, vendor/llama.cpp/src/llama-vocab.cpp, llama_vocab::impl::load: a token
# spelled as one of EOG_NAMES ends a generation (the special_eog_ids list), and so do the FIM
# pad, repo and file-separator tokens, the first token found under each FIM_NAMES entry where the
# file names none. llama.cpp makes all of these control tokens.
EOG_NAMES = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
             "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
             "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
             "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[")
FIM_NAMES = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>",
            "<PRE>", "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>",
            "<SUF>", "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>",
            "<MID>", "\u2581<MID>", "<|code_middle|>", "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}


def fim_ids(vocab: dict[str, int]) -> dict[str, int]:
    """FIM kind ("pre", "suf", ...) -> the id llama.cpp takes for it by name: the lowest-numbered
    token spelled as one of FIM_NAMES[kind] (llama.cpp takes whichever its hash map yields
    first)."""
    found = {kind: [vocab[n] for n in names if n in vocab] for kind, names in FIM_NAMES.items()}
    return {kind: min(ids) for kind, ids in found.items() if ids}


def llama_cpp_stop_ids(vocab: dict[str, int], ids: Iterable[int | None]) -> tuple[int, ...]:
    """The ids llama.cpp ends a generation at, EOS first: `ids` (EOS, then EOT, EOM, FIM pad /
    repo / separator ids as a file gives them; None skipped), every token named in EOG_NAMES, less
    llama.cpp's two exceptions: <|end|> where <|return|> and <|call|> (or <|calls|> and
    <|flush|>) also stop, and </s> where <|tool_response>."""
    ids = [i for i in ids if i is not None]
    named = {vocab[n] for n in EOG_NAMES if n in vocab}
    stops = ids[:1] + sorted((set(ids[1:]) | named) - set(ids[:1]))
    text = {i: t for t, i in vocab.items() if i in stops}
    names = {text.get(i) for i in stops}
    drop = set()
    if "<|end|>" in names and ({"<|return|>", "<|call|>"} <= names or
                               {"<|calls|>", "<|flush|>"} <= names):
        drop.add("<|end|>")
    if "</s>" in names and names & {"<|tool_response>", "<|plamo:eos|>"}:
        drop.add("</s>")
    return tuple(i for i in stops if text.get(i) not in drop)
