"""The weights section of `llama-bridge compare` (bridge.compare.weights): faithful conversions are
the same (float, bfloat16, float16, a chain through bfloat16) or the same within quantisation
(GGUF Q8_0 / Q4_0 and native int8 / int4, each tensor against its own re-quantisation; llama.cpp's
Q4_K_M against the type's measured cost, slow), and the classic broken tensors are caught and
named: q/k rows in the other RoPE layout on a grouped-query model, a broken row or a NaN in a
float, Q8_0, Q4_0, int8 or int4 file, an untied head replaced by the embedding one row off, the
gate and up projections swapped, a norm's (1 + w) offset, a tensor missing, a shape changed,
another model."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from bridge.compare import DIFFERENT, SAME, WITHIN
from bridge.compare.weights import compare_weights
from bridge.convert import convert
from bridge.formats import open_checkpoint
from bridge.formats.base import Checkpoint
from bridge.formats.hf import from_half_split, to_half_split, write_hf
from bridge.gguf.write import write_gguf
from conftest import small_config
from test_gguf import save

# Rows of 64 and 96: whole blocks of 32 for Q8_0 / Q4_0; head_dim 16; GQA: 4 query heads, 2 kv.
CFG = small_config(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96)
WK = "layers.1.attention.wk.weight"


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return save(tmp_path_factory.mktemp("cw") / "src", CFG)


def planted(src: Path, dst: Path, to: str, changes: dict, dtype: str | None = None) -> Path:
    """`src` written as `to` (hf or gguf, `dtype`) by the bridge's own writer, each tensor named
    in `changes` passed through its function first: a converter's bug, planted."""
    ckpt = open_checkpoint(src)

    def fetch(name):
        x = ckpt.tensor(name)
        return changes[name](x) if name in changes else x
    if to == "hf":
        return write_hf(dst, ckpt.config, ckpt.specs, fetch)
    return write_gguf(dst, ckpt.config, ckpt.specs, fetch, dtype=dtype, warn=lambda _: None)


def scaled_row(row: int, by: float = 3.0):
    def change(x):
        x = x.copy()
        x[row] *= by
        return x
    return change


# -- faithful pairs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("to, dtype, expected", [
    ("hf", None, SAME), ("hf", "bfloat16", SAME), ("gguf", "f32", SAME), ("gguf", "bf16", SAME),
    ("gguf", "f16", SAME), ("gguf", "q8_0", WITHIN), ("gguf", "q4_0", WITHIN)])
def test_faithful_conversions_pass(tmp_path, src, to, dtype, expected):
    out = convert(src, tmp_path / ("m.gguf" if to == "gguf" else "m"), to, dtype=dtype,
                  progress=False)
    calls = []
    finding = compare_weights(open_checkpoint(src), open_checkpoint(out),
                              progress=lambda i, n: calls.append((i, n)))
    assert finding.verdict == expected, finding.lines
    assert finding.section == "weights" and finding.cause is None
    json.dumps(finding.to_dict(), allow_nan=False)  # --json's figures: plain numbers
    n = len(open_checkpoint(src).specs)
    assert calls == [(i, n) for i in range(1, n + 1)]
    figures = finding.figures
    assert figures["tensors"] == n and figures["different"] == 0
    if expected == SAME:
        assert figures["same"] == n and not figures["types"]
        limit = {None: 0.0, "bfloat16": 2.0 ** -8, "bf16": 2.0 ** -8, "f16": 2.0 ** -11,
                 "f32": 0.0}[dtype]
        assert figures["float"]["largest_relative_difference"] <= limit
        if limit:  # rounded, not copied
            assert figures["float"]["largest_relative_difference"] > 0
    else:
        qtype = dtype.upper()
        t = figures["types"][qtype]
        # the file holds gguf's own quantisation of A's tensors: exactly the reference's error
        assert t["reference"] == [f"{qtype} re-quantised"]
        assert t["median_ratio"] == pytest.approx(1.0) and t["max_row_ratio"] == pytest.approx(1.0)
        assert t["rms_relative"] == pytest.approx(t["expected_relative_rms"], rel=0.3)
        assert figures["within"] == t["tensors"] + figures["types"].get("Q8_0", {}).get(
            "tensors", 0) * (qtype != "Q8_0")


@pytest.mark.parametrize("dtype, expected", [("f32", SAME), ("q8_0", WITHIN)])
def test_a_chain_through_bfloat16(tmp_path, src, dtype, expected):
    """float32 -> an HF bfloat16 export -> GGUF: the norms come back float32 but hold bfloat16's
    numbers, and round as bfloat16 did; the matrices are Q8_0 of bfloat16's numbers, a little
    further from A's than A's own re-quantisation."""
    rng = np.random.default_rng(0)  # norms that are not all ones, which bfloat16 holds exactly
    norms = {n: lambda x: x + rng.normal(0, 0.1, x.shape).astype(np.float32)
             for n in open_checkpoint(src).specs if n.endswith("norm.weight")}
    a = planted(src, tmp_path / "a", "hf", norms)
    bf16 = convert(a, tmp_path / "bf16", "hf", dtype="bfloat16", progress=False)
    out = convert(bf16, tmp_path / "m.gguf", "gguf", dtype=dtype, progress=False)
    finding = compare_weights(open_checkpoint(a), open_checkpoint(out))
    assert finding.verdict == expected, finding.lines
    assert 0 < finding.figures["float"]["largest_relative_difference"] <= 2.0 ** -8
    if dtype == "q8_0":
        assert 1.0 < finding.figures["types"]["Q8_0"]["max_ratio"] < 1.1


def test_a_quantised_a_against_a_float_b_is_judged_the_same_way(tmp_path, src):
    out = convert(src, tmp_path / "m.gguf", "gguf", dtype="q4_0", progress=False)
    finding = compare_weights(open_checkpoint(out), open_checkpoint(src))
    assert finding.verdict == WITHIN
    assert finding.figures["types"]["Q4_0"]["max_ratio"] == pytest.approx(1.0)


def test_two_quantisations_of_one_checkpoint_are_within_the_coarser_types_cost(tmp_path, src):
    q4 = open_checkpoint(convert(src, tmp_path / "q4.gguf", "gguf", dtype="q4_0", progress=False))
    q8 = open_checkpoint(convert(src, tmp_path / "q8.gguf", "gguf", dtype="q8_0", progress=False))
    for a, b in ((q4, q8), (q8, q4)):
        finding = compare_weights(a, b)
        assert finding.verdict == WITHIN, finding.lines
        assert finding.figures["types"]["Q4_0"]["max_ratio"] < 1.1


def test_smollm2_q4_1_against_its_exports(tmp_path, smollm2):
    """The Q4_1 file against its float32 HF export: the same numbers (the export is the file's
    dequantisation). Against a Q8_0 re-export of that: within Q8_0's cost, tensor by tensor."""
    hf = convert(smollm2, tmp_path / "hf", "hf", dtype="float32", progress=False)
    finding = compare_weights(open_checkpoint(smollm2), open_checkpoint(hf))
    assert finding.verdict == SAME, finding.lines
    assert finding.figures["float"]["largest_relative_difference"] == 0.0
    q8 = convert(hf, tmp_path / "q8.gguf", "gguf", dtype="q8_0", progress=False)
    finding = compare_weights(open_checkpoint(smollm2), open_checkpoint(q8))
    assert finding.verdict == WITHIN, finding.lines
    t = finding.figures["types"]["Q8_0"]
    assert t["tensors"] == 211 and t["max_ratio"] == pytest.approx(1.0)


# -- planted bugs: caught and named ----------------------------------------------------------------

@pytest.mark.parametrize("permute, words", [
    (lambda x: to_half_split(x, CFG.n_kv_heads), "other RoPE layout (to_half_split"),
    (lambda x: from_half_split(x, CFG.n_kv_heads), "other RoPE layout (from_half_split"),
    # the grouped-query bug: wk permuted with n_heads (4) where n_kv_heads (2) was due
    (lambda x: from_half_split(to_half_split(x, CFG.n_heads), CFG.n_kv_heads),
     "half-split RoPE layout with 4 heads and back with 2")])
def test_qk_rows_in_the_other_rope_layout(tmp_path, src, permute, words):
    out = planted(src, tmp_path / "m", "hf", {WK: permute})
    finding = compare_weights(open_checkpoint(src), open_checkpoint(out))
    assert finding.verdict == DIFFERENT
    json.dumps(finding.to_dict(), allow_nan=False)  # --json's figures: plain numbers
    assert finding.cause.startswith(f"tensor {WK}: ")
    assert words in finding.cause and "RoPE permutation" in finding.cause, finding.cause
    assert "n_kv_heads" in finding.check_next or "half-split" in finding.check_next
    assert finding.figures["different"] == 1  # every other tensor is A's


@pytest.mark.parametrize("to, dtype, qtype", [("hf", None, None), ("gguf", "q8_0", "Q8_0"),
                                              ("gguf", "q4_0", "Q4_0")])
def test_a_broken_row(tmp_path, src, to, dtype, qtype):
    name = "layers.0.feed_forward.w2.weight"
    out = planted(src, tmp_path / ("m.gguf" if to == "gguf" else "m"), to,
                  {name: scaled_row(5)}, dtype=dtype)
    finding = compare_weights(open_checkpoint(src), open_checkpoint(out))
    assert finding.verdict == DIFFERENT
    # row 5 is 3x A's: it differs by 200% of itself (less what Q4_0's rounding happens to undo)
    assert re.match(rf"tensor {name}: row 5 differs by (19\d|200)%", finding.cause), finding.cause
    assert "1 of 64 rows broken" in finding.cause
    assert [d["tensor"] for d in finding.figures["different_tensors"]] == [name]
    if qtype:  # the rest of the file is within its type's cost
        assert finding.figures["types"][qtype]["max_ratio"] > 1.0  # the broken tensor's
        assert finding.figures["within"] == finding.figures["tensors"] - 1 - finding.figures["same"]


# gguf.quants warns as it quantises the planted NaN's block
@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("to, dtype", [("hf", None), ("gguf", "q8_0")])
def test_a_nan_is_a_difference(tmp_path, src, to, dtype):
    name = "layers.1.feed_forward.w3.weight"

    def nan(x):
        x = x.copy()
        x[11, 3] = np.nan
        return x
    out = planted(src, tmp_path / ("m.gguf" if to == "gguf" else "m"), to, {name: nan},
                  dtype=dtype)
    finding = compare_weights(open_checkpoint(src), open_checkpoint(out))
    assert finding.verdict == DIFFERENT
    assert finding.cause.startswith(f"tensor {name}: row 11 holds a NaN or an infinity")
    json.dumps(finding.to_dict(), allow_nan=False)


def test_a_row_scaled_by_a_third_inside_q4_0_is_caught(tmp_path, src):
    name = "layers.1.attention.wo.weight"
    out = planted(src, tmp_path / "m.gguf", "gguf", {name: scaled_row(7, 1.35)}, dtype="q4_0")
    finding = compare_weights(open_checkpoint(src), open_checkpoint(out))
    assert finding.verdict == DIFFERENT and finding.cause.startswith(f"tensor {name}: row 7 ")


def test_an_untied_head_replaced_by_the_embedding_one_row_off(tmp_path, src):
    emb = open_checkpoint(src).tensor("tok_embeddings.weight")
    out = planted(src, tmp_path / "m", "hf", {"output.weight": lambda x: np.roll(emb, 1, axis=0)})
    finding = compare_weights(open_checkpoint(src), open_checkpoint(out))
    assert finding.verdict == DIFFERENT
    assert finding.cause.startswith("tensor output.weight: ")
    assert "A's token embedding one row down" in finding.cause
    assert "LM head" in finding.check_next
    # the embedding itself, not shifted
    out = planted(src, tmp_path / "m2", "hf", {"output.weight": lambda x: emb})
    finding = compare_weights(open_checkpoint(src), open_checkpoint(out))
    assert "B's LM head is A's token embedding" in finding.cause


def test_the_head_written_one_row_off_within_q8_0(tmp_path, src):
    out = planted(src, tmp_path / "m.gguf", "gguf",
                  {"output.weight": lambda x: np.roll(x, -1, axis=0)}, dtype="q8_0")
    finding = compare_weights(open_checkpoint(src), open_checkpoint(out))
    assert "B's rows are A's one row up" in finding.cause


def test_a_norm_with_a_one_plus_w_offset_and_a_scaled_matrix(tmp_path, src):
    out = planted(src, tmp_path / "m", "hf", {"layers.0.ffn_norm.weight": lambda x: x - 1.0,
                                              "layers.1.feed_forward.w1.weight": lambda x: 2 * x})
    finding = compare_weights(open_checkpoint(src), open_checkpoint(out))
    assert finding.cause.startswith("tensor layers.0.ffn_norm.weight: ")
    assert "B is A - 1" in finding.cause
    assert any("layers.1.feed_forward.w1.weight" in line and "B is A times 2" in line
               for line in finding.lines)


def test_gate_and_up_swapped_and_layers_one_off(tmp_path, src):
    a = open_checkpoint(src)
    out = planted(src, tmp_path / "m", "hf", {
        "layers.0.feed_forward.w1.weight": lambda x: a.tensor("layers.0.feed_forward.w3.weight"),
        "layers.0.feed_forward.w3.weight": lambda x: a.tensor("layers.0.feed_forward.w1.weight"),
        "layers.1.attention.wo.weight": lambda x: a.tensor("layers.0.attention.wo.weight")})
    finding = compare_weights(a, open_checkpoint(out))
    assert finding.cause.startswith("tensor layers.0.feed_forward.w1.weight: ")
    assert "B's tensor is A's layers.0.feed_forward.w3.weight" in finding.cause
    assert "w1 is the gate" in finding.check_next
    assert any(line.startswith("tensor layers.1.attention.wo.weight: ") and
               "B's tensor is A's layers.0.attention.wo.weight" in line for line in finding.lines)
    assert finding.figures["different"] == 3


def test_a_whole_tensor_scaled_by_a_thousandth_is_named_as_a_scale(tmp_path, src):
    """0.1% is far past float32's rounding and far inside Q8_0's: named as a scale in float32."""
    name = "layers.1.attention.wv.weight"
    out = planted(src, tmp_path / "m", "hf", {name: lambda x: x * np.float32(1.001)})
    finding = compare_weights(open_checkpoint(src), open_checkpoint(out))
    assert finding.cause.startswith(f"tensor {name}: ") and "B is A times 1.001" in finding.cause
    # negative: the same tensor with noise of the same size is no scale
    rng = np.random.default_rng(0)
    out = planted(src, tmp_path / "n", "hf",
                  {name: lambda x: x * (1 + 0.001 * rng.standard_normal(x.shape)).astype(x.dtype)})
    finding = compare_weights(open_checkpoint(src), open_checkpoint(out))
    assert finding.verdict == DIFFERENT and "times" not in finding.cause


def test_embedding_rows_swapped_are_named_with_the_rows_they_came_from(tmp_path, src):
    """Token ids renumbered by a conversion: B's rows 3 and 9 are A's 9 and 3."""
    order = np.arange(CFG.vocab_size)
    order[[3, 9]] = order[[9, 3]]
    out = planted(src, tmp_path / "m", "hf", {"tok_embeddings.weight": lambda x: x[order]})
    finding = compare_weights(open_checkpoint(src), open_checkpoint(out))
    assert "2 rows moved among themselves: B's row 3 is A's row 9, row 9 is A's row 3" \
        in finding.cause, finding.cause
    assert "vocabulary's order" in finding.check_next
    # negative: two rows overwritten, not swapped, are broken rows
    out = planted(src, tmp_path / "n", "hf", {"tok_embeddings.weight": scaled_row(3)})
    finding = compare_weights(open_checkpoint(src), open_checkpoint(out))
    assert "moved" not in finding.cause and "1 of" in finding.cause


class Dropped(Checkpoint):
    """A checkpoint without one tensor (what no reader opens, but a compare must still say)."""

    def __init__(self, inner, name):
        self.inner, self.path, self.config = inner, inner.path, inner.config
        self.specs = {n: s for n, s in inner.specs.items() if n != name}

    def tensor(self, name):
        return self.inner.tensor(name)


def test_a_missing_tensor_another_shape_and_another_model(tmp_path, src):
    a = open_checkpoint(src)
    finding = compare_weights(a, Dropped(a, "layers.1.feed_forward.w3.weight"))
    assert finding.verdict == DIFFERENT
    assert finding.cause.startswith("tensor layers.1.feed_forward.w3.weight is in A only")

    other = open_checkpoint(save(tmp_path / "v", CFG.replace(vocab_size=98)))
    finding = compare_weights(a, other)
    assert finding.cause == "tensor tok_embeddings.weight: shape (97, 64) in A, (98, 64) in B"

    other = open_checkpoint(save(tmp_path / "seed", CFG, seed=1))
    finding = compare_weights(a, other)
    assert finding.verdict == DIFFERENT and finding.cause.startswith("tensor tok_embeddings")
    assert "the whole tensor differs" in finding.cause
    assert finding.figures["different"] == len(a.specs) - 5  # the norms are all ones in both


class Untied(Checkpoint):
    """A tied checkpoint written out untied: its output.weight is `head` (default the embedding)."""

    def __init__(self, inner, head=None):
        self.inner, self.path, self.head = inner, inner.path, head
        self.config = inner.config.replace(tie_embeddings=False)
        self.specs = {**inner.specs, "output.weight": inner.specs["tok_embeddings.weight"]}

    def tensor(self, name):
        if name == "output.weight":
            return self.inner.tensor("tok_embeddings.weight") if self.head is None else self.head
        return self.inner.tensor(name)


def test_a_tied_head_against_an_untied_one(tmp_path):
    """A tied head is its embedding: an untied copy of it is the same; a lost tie, where the
    head written is not the embedding, is named."""
    tied = open_checkpoint(save(tmp_path / "t", CFG.replace(tie_embeddings=True)))
    for a, b in ((tied, Untied(tied)), (Untied(tied), tied)):
        finding = compare_weights(a, b)
        assert finding.verdict == SAME, finding.lines
        assert finding.figures["tensors"] == len(tied.specs) + 1
        side = "A" if a is tied else "B"
        assert f"{side}'s LM head is tied (its token embedding): compared as output.weight" in \
            finding.lines
    other = open_checkpoint(save(tmp_path / "x", CFG)).tensor("output.weight")
    finding = compare_weights(tied, Untied(tied, head=other))
    assert finding.verdict == DIFFERENT and finding.cause.startswith("tensor output.weight: ")


@pytest.mark.parametrize("quantize, group_size, qtype", [
    ("int8", None, "int8"), ("int8", 32, "int8-g32"), ("int4", None, "int4")])
def test_native_int8_and_int4_against_their_float_source(tmp_path, src, quantize, group_size,
                                                         qtype):
    q = convert(src, tmp_path / "q", "native", quantize=quantize, group_size=group_size,
                progress=False)
    finding = compare_weights(open_checkpoint(src), open_checkpoint(q))
    assert finding.verdict == WITHIN, finding.lines
    t = finding.figures["types"][qtype]
    assert t["tensors"] == 7 * CFG.n_layers + 1  # the projections and the (untied) head
    assert t["reference"] == [f"{qtype} re-quantised"] and t["max_ratio"] == pytest.approx(1.0)

    # a broken row, quantised by the same quantiser
    name = "layers.0.attention.wv.weight"
    broken = tmp_path / "broken"
    planted(src, broken, "hf", {name: scaled_row(3, 1.5)})
    q = convert(broken, tmp_path / "qb", "native", quantize=quantize, group_size=group_size,
                progress=False)
    finding = compare_weights(open_checkpoint(src), open_checkpoint(q))
    assert finding.verdict == DIFFERENT and finding.cause.startswith(f"tensor {name}: row 3 ")


@pytest.mark.slow
def test_smollm2_q4_k_m_by_llama_cpp(tmp_path, smollm2):
    """llama.cpp's own Q4_K_M of SmolLM2's float32 export: within what each type costs (its Q4_K
    and Q6_K against the table, the Q5_0 / Q8_0 it falls back to re-quantised); a row broken
    before quantising is still caught through llama.cpp's quantiser."""
    pytest.importorskip("llama_cpp")
    hf = convert(smollm2, tmp_path / "hf", "hf", dtype="float32", progress=False)
    q = convert(hf, tmp_path / "q.gguf", "gguf", dtype="q4_k_m", progress=False)
    finding = compare_weights(open_checkpoint(hf), open_checkpoint(q))
    assert finding.verdict == WITHIN, finding.lines
    types = finding.figures["types"]
    assert types["Q4_K"]["reference"] == ["Q4_K table"]
    assert types["Q5_0"]["reference"] == ["Q5_0 re-quantised"]

    name = "layers.3.feed_forward.w2.weight"  # rows of 1536: whole K-quant blocks
    broken = planted(hf, tmp_path / "broken", "hf", {name: scaled_row(9, 1.5)})
    for f in open_checkpoint(hf).extra_files:
        shutil.copy(f, broken)
    q = convert(broken, tmp_path / "qb.gguf", "gguf", dtype="q4_k_m", progress=False)
    finding = compare_weights(open_checkpoint(hf), open_checkpoint(q))
    assert finding.verdict == DIFFERENT and finding.cause.startswith(f"tensor {name}: row 9 ")
