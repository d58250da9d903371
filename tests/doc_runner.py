"""Runs the python blocks of one documentation page, in order, in one namespace (what a reader
typing them into one session gets): `python doc_runner.py BLOCKS.json RESULTS.json`.

BLOCKS.json: {"page": str, "blocks": [{"line": int, "source": str}, ...]}. RESULTS.json, written
after every block (so that a crash or a timeout leaves the blocks that ran): a list of
{"stdout": str, "error": traceback or null, "seconds": float}, one per block run; the first error ends the page.
tests/test_docs.py starts it, one fresh process per page, so JAX's state and memory never leak
from one page into the next.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
import traceback


def main(blocks_path: str, results_path: str) -> int:
    spec = json.loads(open(blocks_path, encoding="utf-8").read())
    namespace = {"__name__": "__main__"}
    results = []
    for number, block in enumerate(spec["blocks"], start=1):
        out = io.StringIO()
        error, started = None, time.perf_counter()
        try:
            code = compile(block["source"], f"{spec['page']}, block {number} (line {block['line']})",
                           "exec")
            with contextlib.redirect_stdout(out):
                exec(code, namespace)
        except BaseException:  # SystemExit and KeyboardInterrupt included: the page failed
            error = traceback.format_exc()
        results.append({"stdout": out.getvalue(), "error": error,
                        "seconds": round(time.perf_counter() - started, 2)})
        with open(results_path, "w", encoding="utf-8") as f:
            json.dump(results, f)
        if error is not None:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
