"""Write a directory or a file so that readers see all of it or none of it.

Everything is written into a hidden temporary directory (or file) `.DST.partial-XXXXXXXX` beside
the destination and renamed into place at the end; an exception (or a kill) leaves the
destination untouched. The writer holds an advisory lock (flock) on its temporary for as long as
it lives, so a kill -9 - which runs no cleanup - leaves an unlocked `.DST.partial-*` behind, and
the next write to the same destination removes every such stale one it can lock (live writers'
temporaries stay locked and untouched). Two writers racing for one destination: the first rename
wins, the other gets a BridgeError ("already exists") and removes its temporary. A full disk (or
any OS error writing the temporary) becomes a one-line BridgeError naming the destination and,
where the writer says how many bytes it needs (`needed_bytes`), those and the bytes that were
free; a write that cannot fit is refused by the same line before anything is written.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from .errors import BridgeError

try:
    import fcntl
except ImportError:  # Windows: no flock, so no stale-temporary cleanup either
    fcntl = None

# A directory we may replace must look like something this project wrote.
_REPLACEABLE_MARKERS = ("config.json", "params.json", "adapter_config.json")
# OS errors that can only come from writing (reads never report them): a full disk or quota, a
# file-size limit, a read-only file system.
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}
# What rename reports when the destination appeared meanwhile (another writer won the race).
_TAKEN_ERRNOS = {errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR}
# A file system this close to full refuses writes: some blocks are kept back for its metadata.
_NEARLY_FULL = 1 << 20
# mkdtemp / mkstemp create 0700 / 0600; the result should get the usual permissions instead.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def _try_lock(fd: int) -> bool | None:
    """flock(fd) without waiting: True locked, False someone else holds it, None unsupported."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        return False if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) else None


def _claim(path: Path, fd: int) -> bool:
    """Lock our fresh temporary at `path` (open as `fd`). False when a concurrent cleanup got
    there between its creation and our lock (it then removes it; the caller makes another)."""
    if _try_lock(fd) is False:
        return False
    try:  # a cleanup may have locked, removed and released it just before our lock
        return os.path.samestat(os.stat(path, follow_symlinks=False), os.fstat(fd))
    except FileNotFoundError:
        return False


def _locked_temp(dst: Path, kind: str, directory: bool) -> tuple[Path, int]:
    """A fresh `.DST.{kind}-XXXXXXXX` directory or file beside `dst`, and a locked fd on it."""
    while True:
        if directory:
            path = Path(tempfile.mkdtemp(prefix=f".{dst.name}.{kind}-", dir=dst.parent))
            fd = os.open(path, os.O_RDONLY)
        else:
            fd, name = tempfile.mkstemp(prefix=f".{dst.name}.{kind}-", dir=dst.parent)
            path = Path(name)
        if _claim(path, fd):
            return path, fd
        os.close(fd)


def remove_stale_temporaries(dst: str | os.PathLike) -> list[Path]:
    """Remove the `.DST.partial-*` (and `.DST.old-*`, once DST exists) left beside `dst` by
    killed writers: those nobody holds a lock on. Returns what was removed."""
    dst = Path(dst)
    if fcntl is None or not dst.parent.is_dir():
        return []
    kinds = (f".{dst.name}.partial-",) + ((f".{dst.name}.old-",) if dst.exists() else ())
    removed = []
    for path in dst.parent.iterdir():
        if not path.name.startswith(kinds) or path.is_symlink():
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            if _try_lock(fd) is True:
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                removed.append(path)
        finally:
            os.close(fd)
    return removed


def _is_write_error(e: OSError, tmp: Path) -> bool:
    if e.errno in _WRITE_ERRNOS:
        return True
    inside = os.path.abspath(tmp)
    return any(f is not None and (os.path.abspath(f) + os.sep).startswith(inside + os.sep)
               for f in (e.filename, e.filename2))


def _failure_reason(e: BaseException, tmp: Path) -> str | None:
    """Why writing the temporary `tmp` failed, as the OS says it, or None when `e` is no write
    failure (bad input, a bug, a source that cannot be read). Asked before `tmp` is removed, so
    that a disk it filled is seen full."""
    if isinstance(e, OSError) and _is_write_error(e, tmp):
        return e.strerror or str(e)
    if not isinstance(e, (OSError, RuntimeError)) or getattr(e, "errno", None) is not None:
        return None
    # What says no reason: numpy's short writes (an OSError "N requested and M written", no
    # errno) and torch.save's C++ writer (a RuntimeError). The OS refused for a full disk or a
    # file-size limit.
    if _free_space(tmp)[0] < _NEARLY_FULL:
        return os.strerror(errno.ENOSPC)
    try:
        import resource
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError):
        return None
    if limit == resource.RLIM_INFINITY:
        return None
    return f"{os.strerror(errno.EFBIG)}: the file size limit is {limit} bytes"


def describe_bytes(n: int) -> str:
    """A size in decimal units, as `df -H` and the Hugging Face hub write them: 538_183_424 ->
    '538.2 MB', 900 -> '900 bytes'."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _free_space(path: Path) -> tuple[int, Path]:
    """The bytes this process may still write on the file system that holds `path` (or would:
    its nearest existing ancestor), and where that file system is mounted."""
    path = Path(os.path.abspath(path))
    while not path.exists():
        path = path.parent
    free, device = shutil.disk_usage(path).free, path.stat().st_dev
    while path.parent != path and path.parent.stat().st_dev == device:
        path = path.parent
    return free, path


def _write_failed(dst: Path, reason: str | OSError, space: str = "",
                  what: str = "the output") -> BridgeError:
    if isinstance(reason, OSError):
        reason = reason.strerror or str(reason)
    return BridgeError(f"{dst}: cannot write {what} ({reason}){space}; nothing was written")


def _checked_space(dst: Path, needed: int, what: str = "the output") -> str:
    """check_free_space, returning the words for the space when it fits, for a failure later:
    ': it needs N MB, F MB were free on MOUNT'. (A failure later reports the bytes free when the
    write began: a failed writer's open files may hold on to their blocks a while after it has
    removed them, so the bytes free then say little.)"""
    free, mount = _free_space(dst.parent)
    space = f": it needs {describe_bytes(needed)}, {describe_bytes(free)} were free on {mount}"
    if free < needed:
        raise _write_failed(dst, os.strerror(errno.ENOSPC), space, what)
    return space


def check_free_space(dst: Path, needed: int, what: str = "the output") -> None:
    """Refuse, before anything is written, to write `needed` bytes at `dst` when the file system
    it would go on (that of its nearest existing ancestor) has fewer free: a BridgeError
    "DST: cannot write WHAT (No space left on device): it needs N MB, F MB were free on MOUNT;
    nothing was written". `needed` should be a lower bound (the tensors' bytes, say), so that a
    write that fits is never refused; a disk that fills meanwhile is still caught as it writes."""
    _checked_space(Path(dst), needed, what)


def _prepare(dst: Path) -> None:
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BridgeError(f"{dst}: cannot create its directory ({e.strerror or e})") from None
    remove_stale_temporaries(dst)


@contextmanager
def atomic_directory(dst: str | os.PathLike, overwrite: bool = False,
                     needed_bytes: int | None = None) -> Iterator[Path]:
    """Yield a temporary directory; on success it becomes `dst`, on failure it is removed.

    An existing `dst` is refused unless `overwrite`, and even then only when it is a checkpoint
    directory (holds config.json, params.json or a LoRA adapter's adapter_config.json), never
    an arbitrary folder or a file. `needed_bytes`: about what the writer will put there, at least
    (check_free_space); a full disk's error then names it.
    """
    dst = Path(dst)
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise BridgeError(f"{dst}: already exists (pass overwrite=True / --force to replace it)")
        if not dst.is_dir() or not any((dst / m).is_file() for m in _REPLACEABLE_MARKERS):
            raise BridgeError(f"{dst}: exists and is not a checkpoint directory; refusing to replace it")

    def place(tmp: Path) -> None:
        os.chmod(tmp, 0o777 & ~_UMASK)
        _rename_into_place(tmp, dst, overwrite)

    with _temporary(dst, directory=True, place=place, needed=needed_bytes) as tmp:
        yield tmp


def _rename_into_place(tmp: Path, dst: Path, overwrite: bool) -> None:
    old = old_fd = None
    try:
        if overwrite and (dst.exists() or dst.is_symlink()):
            old, old_fd = _locked_temp(dst, "old", directory=True)
            os.rename(dst, old / "previous")
        try:
            os.rename(tmp, dst)  # fails if a non-empty dst appeared meanwhile: never merges
        except OSError as e:
            if old is not None:
                try:
                    os.rename(old / "previous", dst)
                except OSError:
                    pass
            if e.errno in _TAKEN_ERRNOS:
                raise BridgeError(f"{dst}: already exists (another process wrote it meanwhile); "
                                  f"nothing was written") from None
            raise _write_failed(dst, e) from None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if old_fd is not None:
            os.close(old_fd)


@contextmanager
def atomic_file(dst: str | os.PathLike, overwrite: bool = False,
                needed_bytes: int | None = None) -> Iterator[Path]:
    """Yield a temporary file path beside `dst`; on success it is renamed to `dst`.
    `needed_bytes` as for atomic_directory."""
    dst = Path(dst)
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise BridgeError(f"{dst}: already exists (pass overwrite=True / --force to replace it)")
        if not dst.is_file():
            raise BridgeError(f"{dst}: exists and is not a file; refusing to replace it")

    def place(tmp: Path) -> None:
        os.chmod(tmp, 0o666 & ~_UMASK)
        if overwrite:
            os.replace(tmp, dst)
        else:
            _link_into_place(tmp, dst)

    with _temporary(dst, directory=False, place=place, needed=needed_bytes) as tmp:
        yield tmp


@contextmanager
def _temporary(dst: Path, directory: bool, place, needed: int | None) -> Iterator[Path]:
    """The life of a writer's locked `.DST.partial-*` temporary: made (dead writers' leftovers
    cleaned first, then refused if `needed` bytes cannot fit), yielded, `place(tmp)` on success,
    removed on any failure; a failure to write it is named as the destination's."""
    _prepare(dst)
    space = "" if needed is None else _checked_space(dst, needed)
    try:
        tmp, fd = _locked_temp(dst, "partial", directory=directory)
    except OSError as e:
        raise _write_failed(dst, e, space) from None
    reason = None
    try:
        try:
            yield tmp
        except BaseException as e:
            reason = _failure_reason(e, tmp)
            raise
        place(tmp)
    except BaseException:
        if directory:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        if reason is None:
            raise
        raise _write_failed(dst, reason, space and f"{space} when it began") from None
    finally:
        os.close(fd)


def _link_into_place(tmp: Path, dst: Path) -> None:
    """Move `tmp` to `dst` unless `dst` exists by now: link() refuses atomically where rename
    would replace."""
    try:
        os.link(tmp, dst)
    except FileExistsError:
        raise BridgeError(f"{dst}: already exists (another process wrote it meanwhile); "
                          f"nothing was written") from None
    except OSError:  # a file system without hard links: check, then rename (a tiny window)
        if dst.exists() or dst.is_symlink():
            raise BridgeError(f"{dst}: already exists (another process wrote it meanwhile); "
                              f"nothing was written") from None
        os.replace(tmp, dst)
        return
    tmp.unlink()


def write_text(path: str | os.PathLike, text: str, overwrite: bool = True) -> Path:
    """Write `text` (UTF-8) to the file at `path` atomically: readers see the old file or the
    new one, never a part. Replaces an existing file unless overwrite=False."""
    path = Path(path)
    with atomic_file(path, overwrite=overwrite) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return path


def copy_files(files: Iterable[Path], directory: Path) -> None:
    """Copy each file into `directory` under its own name (tokenizer files next to weights)."""
    for f in files:
        shutil.copyfile(f, directory / Path(f).name)
