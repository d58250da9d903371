"""bridge.resources' switches: each is set for its block and given back as it was."""

import pytest

import jax_llama.checkpoint
import torch_llama.checkpoint
from bridge.resources import small_pages

multiarray = pytest.importorskip("numpy._core.multiarray")


def test_small_pages_turns_numpys_huge_pages_off_for_its_block_and_back():
    was = multiarray._get_madvise_hugepage()
    try:
        multiarray._set_madvise_hugepage(True)
        with small_pages():
            assert multiarray._get_madvise_hugepage() is False
        assert multiarray._get_madvise_hugepage() is True
        with pytest.raises(ValueError), small_pages():  # given back on an error too
            raise ValueError
        assert multiarray._get_madvise_hugepage() is True
        multiarray._set_madvise_hugepage(False)  # off before: off after
        with small_pages():
            pass
        assert multiarray._get_madvise_hugepage() is False
    finally:
        multiarray._set_madvise_hugepage(was)


@pytest.mark.parametrize("twin", [jax_llama.checkpoint, torch_llama.checkpoint])
def test_both_twins_load_in_small_pages(twin, monkeypatch):
    """Each twin's load runs its reading inside small_pages (its fresh arrays are most of a
    load's memory), and numpy's setting is as it was once the load returns."""
    seen = []
    monkeypatch.setattr(twin, "_load", lambda *a, **k: seen.append(
        multiarray._get_madvise_hugepage()))
    before = multiarray._get_madvise_hugepage()
    twin.load("any path")
    assert seen == [False] and multiarray._get_madvise_hugepage() == before
