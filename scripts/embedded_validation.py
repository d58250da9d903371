"""The validation split of a `jax-llama train` run on a text corpus, written out as text files, so
that `jax-llama eval` / `torch-llama eval` can score exactly the text the run held out.

    python scripts/embedded_validation.py runs/main OUT_DIR

The run's corpus (its --data, or the embedded default: the standard library's sources) is
tokenized again with the run's tokenizer (the token cache beside the run answers at once), split
as training split it (jax_llama.training.data.split: the last 5% of the tokens, as jax_llama.training.loop holds
out), and cut at each BOS into its documents (the corpus frames every file as BOS text EOS). Each
document's tokens, without BOS and EOS, are decoded into OUT_DIR/validation-NNN.txt. The first is
the tail of a file that the split cuts in two, so its text starts where the split does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

VAL_FRACTION = 0.05  # jax_llama.training.lm.corpus_batches holds out this fraction of the tokens


def main(argv=None) -> int:
    from bridge.tokenizer import load_tokenizer
    from jax_llama.training import data as data_lib

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a jax-llama train run directory (run.json, tokenizer/)")
    p.add_argument("out", help="directory for validation-NNN.txt (created; must be empty)")
    args = p.parse_args(argv)

    run, out = Path(args.run), Path(args.out)
    record = json.loads((run / "run.json").read_text())
    if record.get("strip_labels") or record.get("sft"):
        print("error: only plain text corpora (no --strip-labels, no sft)", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(run / "tokenizer")
    files = (data_lib.corpus_files(record["data"]) if record.get("data")
             else data_lib.default_corpus())
    tokens = data_lib.tokenize_corpus(files, tokenizer, run.parent / "token-cache")
    _, val = data_lib.split(tokens, VAL_FRACTION, record["train"]["seq_len"] + 1)
    val = np.asarray(val)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        print(f"error: {out} is not empty", file=sys.stderr)
        return 2
    framing = {tokenizer.bos_id, tokenizer.eos_id} - {None}
    n_files = n_bytes = 0
    for start, length in data_lib.documents(val, tokenizer.bos_id):
        ids = [int(t) for t in val[start:start + length] if int(t) not in framing]
        if not ids:
            continue
        text = tokenizer.decode(ids)
        (out / f"validation-{n_files:03d}.txt").write_text(text, encoding="utf-8", newline="")
        n_files += 1
        n_bytes += len(text.encode("utf-8"))
    print(f"{len(val):,} validation tokens of {len(tokens):,}: {n_files} documents, "
          f"{n_bytes:,} bytes of text in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
