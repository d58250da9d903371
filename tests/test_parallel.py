"""bridge.parallel: a tensor's chunks of rows on the CPU's cores, the same numbers as one thread."""

from __future__ import annotations

import multiprocessing
import threading

import gguf
import numpy as np
import pytest

from bridge import parallel
from bridge.errors import BridgeError
from bridge.parallel import by_chunks


@pytest.mark.parametrize("total,step", [(0, 4), (1, 4), (10, 3), (12, 3), (5, 100), (7, 0)])
@pytest.mark.parametrize("workers", [1, 2, 5])
def test_chunks_cover_the_rows_once_in_order(total, step, workers):
    got = by_chunks(lambda a, b: (a, b), total, step, workers=workers)
    step = max(1, step)
    assert got == [(a, min(a + step, total)) for a in range(0, total, step)]


def test_chunks_run_on_other_threads_and_a_chunks_own_chunks_in_its_thread():
    """Several chunks go to the pool's threads (the point of it; negative of a serial loop); a
    chunk that asks for chunks of its own runs them itself, rather than waiting on the threads
    that are running it (two workers, each waiting on the other, would never finish)."""
    seen = []

    def outer(a, b):
        mine = threading.get_ident()
        inner = by_chunks(lambda c, d: threading.get_ident(), 8, 1, workers=2)
        seen.append(mine)
        return all(t == mine for t in inner)

    assert all(by_chunks(outer, 6, 1, workers=2))
    assert threading.get_ident() not in seen
    assert by_chunks(lambda a, b: threading.get_ident(), 3, 1, workers=1) == \
        [threading.get_ident()] * 3


def test_a_chunks_error_reaches_the_caller():
    def fail(a, b):
        if a == 4:
            raise BridgeError("tensor 'w': chunk 4")
        return a

    with pytest.raises(BridgeError, match="chunk 4"):
        by_chunks(fail, 8, 2, workers=2)


def _in_child(queue):
    queue.put(by_chunks(lambda a, b: a * b, 6, 2, workers=2))


def test_a_forked_child_starts_its_own_threads():
    """After a fork the parent's pool threads do not exist in the child: its chunks must still
    run (they would wait forever on the parent's pool)."""
    by_chunks(lambda a, b: a, 4, 1, workers=2)  # the parent's pool exists
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_in_child, args=(queue,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert queue.get(timeout=5) == [0, 8, 24]


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_readers_give_the_same_bytes_on_one_core_and_on_several(kind, monkeypatch):
    """llama.cpp blocks repacked into 4-bit weights (Q4_0, Q4_1), dequantised to float32 (every
    type), and quantised to int8 rows (the nearest layout's embedding) and to 4-bit weights (a
    Q4_K's): the same bytes and the same errors on one thread as on three, with many chunks a
    tensor, and the numbers of quantising the whole tensor at once."""
    import bridge.gguf.read as read
    import bridge.int4
    from bridge.gguf.int4 import from_q4_blocks

    w = np.random.default_rng(2).standard_normal((67, 256)).astype(np.float32)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    raw = gguf.quants.quantize(w, qtype)
    monkeypatch.setattr(read, "_DEQUANT_CHUNK", 256 * 3)  # 3 rows a chunk
    monkeypatch.setattr(bridge.int4, "ROWS_CHUNK_ELEMENTS", 256 * 5)

    def everything():
        file = type("File", (), {"raw": lambda self, t: raw.reshape(-1),
                                 "release": lambda self, t, first=0, stop=None: None})()
        tensor = type("T", (), {"shape": w.shape})()
        floats = read._as_array(file, tensor, qtype)
        reader = bridge.int4.QuantisedReader.__new__(bridge.int4.QuantisedReader)
        reader.shapes, reader.errors = {"w": w.shape}, {}
        reader.rows = lambda name, index: floats[index]
        rows = reader._by_rows("w", "rows", "int8")
        four = reader._by_rows("w", "four", "int4")
        held = from_q4_blocks(raw, kind, w.shape, chunk_bytes=300) if kind != "Q8_0" else ()
        return floats, rows + four, reader.errors, held

    monkeypatch.setattr(parallel, "cores", lambda: 1)
    one = everything()
    monkeypatch.setattr(parallel, "cores", lambda: 3)
    three = everything()
    np.testing.assert_array_equal(one[0], gguf.quants.dequantize(raw, qtype))
    np.testing.assert_array_equal(three[0], one[0])
    for a, b in zip(three[1], one[1]):
        np.testing.assert_array_equal(a, b)
    assert three[2] == one[2] and set(one[2]) == {"rows", "four"}
    from bridge.int4 import quantize_int4
    from bridge.quantize import quantize_weight
    for a, b in zip(one[1], quantize_weight(one[0]) + quantize_int4(one[0])):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(three[3], one[3]):
        assert (a is None and b is None) or np.array_equal(a, b)
