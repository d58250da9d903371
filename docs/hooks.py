"""MkDocs hook (mkdocs.yml `hooks:`): the pages generated from the code and from results/ at build
time, so that no fact is written twice by hand.

on_files adds to the build, as files that exist only in memory (mkdocs' File.generated):

- reference/cli.md: every command and subcommand of llama-bridge, jax-llama and torch-llama, read
  from their argparse parser objects (llama_twins.cli.docs): usage, description, options table;
- reference/presets.md: bridge.config.PRESETS as a table, with each preset's parameter count;
- explanation/results.md: every results/FOLDER/*.md as a section, one group per folder in the
  order of RESULT_GROUPS, with each heading moved one level down and the plot beside it
  (results/FOLDER/NAME.png) shown;
- explanation/results/*.png: the plots, copied from results/ (outside docs/) into the site.

A hand-written file at a generated page's path is an error: the page is generated. on_serve
makes `mkdocs serve` rebuild when results/ or the parsers change.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the packages, when the docs are built from a plain checkout
    sys.path.insert(0, str(ROOT))

log = logging.getLogger("mkdocs.hooks.jax_llama")

RESULTS = ROOT / "results"
# The results page's order: (section, its folder of results/, the files in it by stem, first
# to last). A file of the folder not named comes after the named ones, and a folder not here
# under "Other results" at the end, so a new result is shown before it is placed.
RESULT_GROUPS: list[tuple[str, str, list[str]]] = [
    ("Parity: do the twins agree?", "parity", ["parity", "parity_memory"]),
    ("Conversion and import", "formats", ["convert", "gguf_import", "mesh_load_memory",
                                          "hand_back"]),
    ("Speed against transformers", "bench", ["bench", "bench_smollm2",
                                             "bench_smollm2_amd", "gemm", "long"]),
    ("Generation and serving", "decode", ["generate", "generate_amd", "generate_smollm2",
                                          "generate_smollm2_amd", "int8_matmul", "serve",
                                          "serve_amd"]),
    ("Training and fine-tuning", "train", ["train", "finetune_pretrained", "bench_frozen_cache",
                                           "bench_frozen_cache_amd",
                                           "lora_bench", "bench_smollm2_lora",
                                           "bench_smollm2_lora_amd",
                                           "bench_smollm2_train_lora",
                                           "bench_smollm2_train_lora_amd", "sft_pretrained",
                                           "dpo_pretrained"]),
    ("Classification", "classify", ["classify", "classify_lora", "classify_lora_emb",
                                    "zero_shot"]),
    ("Evaluation and quality", "quality", ["smollm2_eval", "smollm2_eval_amd", "eval",
                                           "harness", "int8_quality"]),
    ("Reliability", "reliability", ["reliability", "reliability_amd"]),
    ("On a GPU", "gpu", ["gpu"]),
]
RESULT_IMAGES = "explanation/results"  # where results/*.png land in the site


# -- reference/cli.md ---------------------------------------------------------------------------

def cli_page() -> str:
    from llama_twins.cli.docs import build_parsers, command_reference

    parsers = build_parsers()
    parts = ["# Command-line reference\n",
             "Generated at build time from the commands' own argparse parsers "
             "(`llama_twins.cli.docs`), so it lists exactly the options each command accepts. "
             "Every option states its default; `tests/test_cli_help.py` fails on one that does "
             "not. Exit codes: [errors and exit codes](errors.md).\n"]
    for prog in ("llama-bridge", "jax-llama", "torch-llama"):
        parts.append(command_reference(parsers[prog]))
    return "\n".join(parts)


# -- reference/presets.md -----------------------------------------------------------------------

def presets_page() -> str:
    from bridge.config import DEFAULT_PRESET, PRESETS
    from bridge.tensors import count_params
    from llama_twins.cli.docs import markdown_table

    def params(n: int) -> str:
        return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n:,}"

    rows = [[f"`{name}`", c.family + (f" ({', '.join(c.deltas)})" if c.deltas else ""), f"{c.dim:,}", str(c.n_layers), str(c.n_heads), str(c.n_kv_heads),
             str(c.head_dim), f"{c.ffn_dim:,}", f"{c.vocab_size:,}", f"{c.max_seq_len:,}",
             f"{c.rope_theta:g}" + (f" ({c.rope_scaling.type} scaling)" if c.rope_scaling else ""),
             "yes" if c.tie_embeddings else "no", params(count_params(c))]
            for name, c in PRESETS.items()]
    table = markdown_table(rows, ["preset", "family (deltas)", "dim", "layers", "heads", "kv heads", "head dim",
                                  "ffn", "vocab", "max_seq_len", "rope_theta",
                                  "tied embeddings", "parameters"])
    return "\n".join([
        "# Presets\n",
        "The model configurations `--preset` names (`bridge.config.PRESETS`: the published "
        "hyperparameters of each release, as Meta's `params.json` or the Hugging Face "
        "`config.json` give them), generated from the table itself at build time. "
        f"`LlamaConfig()` with no arguments is `{DEFAULT_PRESET}`. Parameter counts come from "
        "the canonical tensor shapes (`bridge.count_params`), embeddings included once when "
        "tied.\n",
        table, ""])


# -- explanation/results.md ---------------------------------------------------------------------

def _demote(markdown: str) -> tuple[str | None, str]:
    """(the file's first-level title or None, the rest with every heading one level down),
    fenced code left alone."""
    title, lines, fenced = None, [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            if level == 1 and title is None and not lines:
                title = line[1:].strip()
                continue
            line = "#" * min(level + 2, 6) + line[level:]  # under the group (##) and file (###)
        lines.append(line)
    return title, "\n".join(lines).strip()


def _result_section(md: Path, shared_titles: set[str]) -> str:
    """The section of one result, md = results/FOLDER/NAME.md."""
    stem, where = md.stem, md.parent.relative_to(ROOT).as_posix()  # results/FOLDER
    title, body = _demote(md.read_text())
    if title in shared_titles:  # e.g. several "jax-llama bench" reports: tell them apart
        title = f"{title}: {stem}"
    # images beside the .md: served from RESULT_IMAGES, one level below this page
    body = re.sub(r"(!\[[^\]]*\]\()(?!https?://|/)([^)\s]+\.png\))",
                  lambda m: f"{m[1]}results/{Path(m[2]).name}", body)
    heading = f"### {title}" if title else f"### `{stem}`"
    source = [f"`{where}/{stem}.md`"]
    if md.with_suffix(".json").exists():
        source.append(f"figures in `{where}/{stem}.json`")
    parts = [heading, "", f"*From {', '.join(source)}.*", "", body]
    if md.with_suffix(".png").exists() and f"results/{stem}.png" not in body:
        parts += ["", f"![{title or stem}](results/{stem}.png)"]
    return "\n".join(parts)


def _ordered(mds: list[Path], stems: list[str]) -> list[Path]:
    """mds in the order of `stems`, those not named after them by name."""
    rank = {stem: i for i, stem in enumerate(stems)}
    return sorted(mds, key=lambda md: (rank.get(md.stem, len(stems)), md.stem))


def results_page() -> str:
    mds = sorted(RESULTS.glob("*/*.md"))
    folders = {folder for _, folder, _ in RESULT_GROUPS}
    groups = [(name, _ordered([md for md in mds if md.parent.name == folder], stems))
              for name, folder, stems in RESULT_GROUPS]
    groups.append(("Other results", [md for md in mds if md.parent.name not in folders]))
    titles = [_demote(md.read_text())[0] for md in mds]
    shared_titles = {t for t in titles if t is not None and titles.count(t) > 1}
    parts = ["# Measured results\n",
             "Every figure this project reports was measured by a script or a command and "
             "written to `results/`, one folder per thing measured: a `.json` file with every "
             "figure behind it, a `.md` table made from it, and a `.png` plot where one helps. "
             "This page renders each `.md` (generated at build time from `results/`, so it "
             "shows exactly what is there), a section per folder; each JSON records the "
             "command, commit, CPU and date it was measured with, and its table ends with "
             "them (or says it was measured before they were kept).\n"]
    for name, group in groups:
        if not group:
            continue
        parts.append(f"## {name}\n")
        parts += [_result_section(md, shared_titles) + "\n" for md in group]
    return "\n".join(parts)


# -- the hook -----------------------------------------------------------------------------------

GENERATED = {
    "reference/cli.md": cli_page,
    "reference/presets.md": presets_page,
    "explanation/results.md": results_page,
}


def on_files(files: Files, *, config) -> Files:
    for uri, generate in GENERATED.items():
        existing = files.get_file_from_path(uri)
        if existing is not None:
            log.error("docs/%s exists, but the page is generated by docs/hooks.py: remove the "
                      "file", uri)
            files.remove(existing)
        files.append(File.generated(config, uri, content=generate()))
    for png in sorted(RESULTS.glob("*/*.png")):  # one flat folder in the site: names unique
        files.append(File.generated(config, f"{RESULT_IMAGES}/{png.name}",
                                    abs_src_path=str(png)))
    return files


def on_serve(server, *, config, builder):
    """`mkdocs serve`: rebuild when what the generated pages are made from changes."""
    for path in (RESULTS, ROOT / "llama_twins", ROOT / "bridge" / "config.py"):
        server.watch(str(path))
    return server
