"""A full disk during a conversion, an export or a merge: one line naming the destination, the bytes
it needs and the bytes that were free, exit 2, nothing left on the disk. Refused before anything is
written when the tensors alone cannot fit; caught as it writes when the disk fills meanwhile; and a
conversion that fits is never refused. Each test meets its full disk on a tmpfs of a few MB
(conftest.small_fs: root on Linux only, skipped with the reason elsewhere)."""

import os
import re

import ml_dtypes
import numpy as np
import pytest

from bridge.atomic import describe_bytes
from bridge.config import LlamaConfig
from bridge.convert import stream_checkpoint
from bridge.formats import open_checkpoint, write_native
from bridge.formats.base import payload_bytes
from bridge.lora import Adapter, LoraConfig, adapter_shapes, write_peft
from bridge.tensors import canonical_shapes
from bridge.tokenizer import ByteTokenizer
from test_convert import run_cli

# 2.1 M parameters: 8.6 MB in float32, 4.3 MB in bfloat16 - more than a 4 MiB disk holds either
# way; written in ~0.05 s. rope_theta and norm_eps as llama2.c hard-codes them, so that every
# format takes it.
CONFIG = LlamaConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=2000,
                     max_seq_len=64, rope_theta=10000.0, norm_eps=1e-5)
SHAPES = canonical_shapes(CONFIG)
TENSOR_BYTES = 4 * sum(int(np.prod(s)) for s in SHAPES.values())
OUTPUTS = {"native": "out", "hf": "out", "meta": "out", "llama2c": "out.bin", "gguf": "out.gguf"}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A random float32 native checkpoint with the byte tokenizer (so that hf and gguf exports
    carry one, and warn of nothing)."""
    path = tmp_path_factory.mktemp("disk-full") / "src"
    rng = np.random.default_rng(0)
    write_native(path, CONFIG, {n: (s, np.dtype(np.float32)) for n, s in SHAPES.items()},
                 lambda n: rng.standard_normal(SHAPES[n], dtype=np.float32))
    ByteTokenizer().save(path)
    return path


@pytest.fixture(scope="module")
def adapter(src):
    lora = LoraConfig(rank=2, alpha=4.0)
    path = src.parent / "adapter"
    write_peft(path, CONFIG, Adapter(lora, {n: np.zeros(s, np.float32)
                                            for n, s in adapter_shapes(CONFIG, lora).items()}))
    return path


def no_space_line(err: str, dst, mount, began: bool = False) -> tuple[float, float]:
    """(needed, free) in MB from the one line a full disk gives, which it checks word for word."""
    when = " when it began" if began else ""
    m = re.fullmatch(rf"(?:error: )?{re.escape(str(dst))}: cannot write the output \(No space left "
                     rf"on device\): it needs ([\d.]+) MB, ([\d.]+) MB were free on "
                     rf"{re.escape(str(mount))}{when}; nothing was written\n?", err)
    assert m, err
    return float(m[1]), float(m[2])


@pytest.mark.parametrize("command, to", [("convert", "native"), ("convert", "hf"),
                                         ("convert", "gguf"), ("convert", "meta"),
                                         ("convert", "llama2c"), ("merge-lora", "native")])
def test_refused_before_writing(src, adapter, small_fs, capsys, command, to):
    """Each format and command: exit 2, one line with the bytes, nothing written on the disk."""
    fs = small_fs(size_mb=4)
    dst = fs / OUTPUTS[to]
    inputs = [src] if command == "convert" else [src, adapter]
    code, out, err = run_cli([command, *inputs, dst, "--to", to, "--quiet"], capsys)
    assert code == 2 and out == "", err
    needed, free = no_space_line(err, dst, fs)
    assert needed >= round(TENSOR_BYTES / 1e6, 1) and free == round(2**22 / 1e6, 1)
    assert os.listdir(fs) == []


@pytest.mark.parametrize("to", OUTPUTS)
def test_disk_filling_meanwhile(src, small_fs, to):
    """The disk has room when the write begins, then another writer takes it: the same line
    (its free bytes as they were at the start), the temporary gone, the other's file untouched."""
    fs = small_fs(size_mb=16)
    dst, other = fs / OUTPUTS[to], fs / "other"

    def fill_the_disk(name, array):  # as the first tensor is read: after the check for room
        if not other.exists():
            other.write_bytes(bytes(os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize - 65536))
        return array

    with pytest.raises(ValueError) as refusal:  # a BridgeError
        stream_checkpoint(src, dst, to, progress=False, prepare=lambda ckpt: fill_the_disk)
    needed, free = no_space_line(str(refusal.value), dst, fs, began=True)
    assert needed < free == round(2**24 / 1e6, 1)
    assert os.listdir(fs) == ["other"]


def test_a_conversion_that_fits_is_not_refused(src, small_fs, capsys):
    """The negative case: 64 KiB more than the tensors and tokenizer files need is enough room
    (for config.json, the safetensors header, and the file system's page rounding)."""
    specs = {n: (s, np.dtype(ml_dtypes.bfloat16)) for n, s in SHAPES.items()}
    needed = payload_bytes(specs, open_checkpoint(src).extra_files)
    fs = small_fs(size_mb=(needed + 65536) / 2**20)
    code, _, err = run_cli(["convert", src, fs / "out", "--dtype", "bfloat16", "--quiet"], capsys)
    assert code == 0, err
    assert os.listdir(fs) == ["out"]
    assert open_checkpoint(fs / "out").nbytes == payload_bytes(specs) > 2**22  # over 4 MiB


def test_describe_bytes():
    assert [describe_bytes(n) for n in (0, 999, 1000, 538_183_424, 1_900_000, 3 * 10**12)] == \
        ["0 bytes", "999 bytes", "1.0 kB", "538.2 MB", "1.9 MB", "3.0 TB"]
