"""Write a directory or a file so that readers see all of it or none of it.

Everything is written into a hidden temporary directory (or file) beside the destination and
renamed into place at the end; an exception (or a kill) leaves the destination untouched.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from .errors import BridgeError

# A directory we may replace must look like something this project wrote.
_REPLACEABLE_MARKERS = ("config.json", "params.json")


@contextmanager
def atomic_directory(dst: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory; on success it becomes `dst`, on failure it is removed.

    An existing `dst` is refused unless `overwrite`, and even then only when it is a checkpoint
    directory (holds config.json or params.json), never an arbitrary folder or a file.
    """
    dst = Path(dst)
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise BridgeError(f"{dst}: already exists (pass overwrite=True / --force to replace it)")
        if not dst.is_dir() or not any((dst / m).is_file() for m in _REPLACEABLE_MARKERS):
            raise BridgeError(f"{dst}: exists and is not a checkpoint directory; refusing to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        yield tmp
        old = None
        if dst.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            os.rename(dst, old / "previous")
        os.rename(tmp, dst)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def atomic_file(dst: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary file path beside `dst`; on success it is renamed to `dst`."""
    dst = Path(dst)
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise BridgeError(f"{dst}: already exists (pass overwrite=True / --force to replace it)")
        if not dst.is_file():
            raise BridgeError(f"{dst}: exists and is not a file; refusing to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{dst.name}.partial-", dir=dst.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def copy_files(files: Iterable[Path], directory: Path) -> None:
    """Copy each file into `directory` under its own name (tokenizer files next to weights)."""
    for f in files:
        shutil.copyfile(f, directory / Path(f).name)
