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


def test_the_command_line_tools_keep_freed_memory_and_a_caller_of_main_does_not(monkeypatch):
    """command_main's entry point, run as a program (argv None), tells glibc's malloc to keep
    freed memory (bridge.resources.keep_freed_memory); called with argv (a test, a caller's own
    process) it leaves the allocator alone. On glibc both settings are taken."""
    import argparse
    import platform
    import sys

    import bridge.resources
    from llama_twins.cli.common import command_main

    calls = []
    monkeypatch.setattr(bridge.resources, "keep_freed_memory", lambda: calls.append(1))
    parser = argparse.ArgumentParser()
    parser.set_defaults(run=lambda args: 0)
    main = command_main(lambda: parser)
    assert main([]) == 0 and calls == []
    monkeypatch.setattr(sys, "argv", ["jax-llama"])
    assert main() == 0 and calls == [1]
    if platform.libc_ver()[0] == "glibc":  # in a process of its own: this one is left alone
        import subprocess
        out = subprocess.run([sys.executable, "-c", "from bridge.resources import "
                              "keep_freed_memory as k; print(k())"], capture_output=True,
                             text=True, check=True).stdout
        assert out.strip() == "True"
