"""Reading inputs and writing outputs whole or not at all."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from .errors import DappleIOError


def read_text(path: str | os.PathLike) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DappleIOError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DappleIOError(f"{path}: is a directory, not a file") from None
    except UnicodeDecodeError as e:
        raise DappleIOError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DappleIOError(f"{path}: cannot read ({e.strerror})") from None


def _temp_beside(path: str | os.PathLike) -> tuple[int, str]:
    """A new temporary file in ``path``'s folder (open descriptor, name)."""
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    try:
        return tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    except OSError as e:
        raise DappleIOError(f"{path}: cannot write ({e.strerror})") from None


def check_writable(path: str | os.PathLike) -> None:
    """Fail now, as :func:`write_atomic` would later, when ``path`` cannot be
    written (a missing or read-only folder): for outputs written at the end
    of long work."""
    fd, tmp = _temp_beside(path)
    os.close(fd)
    os.unlink(tmp)


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) so that readers see the old file or the new one."""
    write_atomic_bytes(path, text.encode("utf-8"))


def write_atomic_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new
    one, never a half-written one."""
    write_atomic_with(path, lambda f: f.write(data))


def write_atomic_with(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> None:
    """Call ``write(f)`` on a temporary file beside ``path``, flush it to
    disk, then rename it over ``path``: readers see the old file or the new
    one. On any error the temporary file is removed."""
    target = Path(path)
    fd, tmp = _temp_beside(path)
    try:
        # mkstemp makes the file private; give it the mode a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as e:
        _remove_quietly(tmp)
        raise DappleIOError(f"{path}: cannot write ({e.strerror})") from None
    except BaseException:
        _remove_quietly(tmp)
        raise


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
