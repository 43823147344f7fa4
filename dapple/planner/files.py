"""Reading inputs and writing outputs whole or not at all."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from .errors import DappleIOError, LimitExceededError
from .limits import MAX_INPUT_BYTES


def special_kind(mode: int) -> str | None:
    """What a file that is not a regular file is ("directory", "FIFO", ...),
    from its ``st_mode``; None for a regular file."""
    for test, name in (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return name
    return None if stat.S_ISREG(mode) else "special file"


def path_text(path: str | os.PathLike) -> str:
    """A file name as text for messages and the core: the bytes of a name
    that is not UTF-8 (which Python holds as lone surrogates, and which no
    UTF-8 text may carry) escaped as ``\\xff``."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _empty_path_error(role: str) -> DappleIOError:
    return DappleIOError(f"'': empty {role} path; give a file name")


def read_text(path: str | os.PathLike) -> str:
    """A regular file's UTF-8 text. Directories, FIFOs, devices and sockets
    are refused without blocking (the file is opened non-blocking and
    checked before anything is read)."""
    if str(path) == "":
        raise _empty_path_error("input")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise DappleIOError(f"{path_text(path)}: no such file") from None
    except IsADirectoryError:
        raise DappleIOError(f"{path_text(path)}: is a directory, not a file") from None
    except OSError as e:
        raise DappleIOError(f"{path_text(path)}: cannot read ({e.strerror})") from None
    try:
        kind = special_kind(os.fstat(fd).st_mode)
        if kind is not None:
            raise DappleIOError(f"{path_text(path)}: is a {kind}, not a regular file")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as f:
            fd = -1  # closed by the file object
            data = f.read(MAX_INPUT_BYTES + 1)  # a sparse file of GiBs is refused, not read
        if len(data) > MAX_INPUT_BYTES:
            raise LimitExceededError(
                f"{path_text(path)}: more than {MAX_INPUT_BYTES // 2**20} MiB, the most dapple reads of one input "
                "(MAX_INPUT_BYTES in planner/limits.py); no profile, topology, plan or metrics file comes near it")
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DappleIOError(f"{path_text(path)}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DappleIOError(f"{path_text(path)}: cannot read ({e.strerror})") from None
    finally:
        if fd >= 0:
            os.close(fd)


def output_target(path: str | os.PathLike) -> Path:
    """The file that writing ``path`` replaces, checked before any work.

    A symlink is followed: its target is replaced atomically and the link
    stays (so a link into a results folder keeps working). Anything that
    exists and is not a regular file (a directory, FIFO, socket or device)
    is refused: renaming over it would replace a device node or never
    reach a reader."""
    if str(path) == "":
        raise _empty_path_error("output")
    if os.fspath(path).endswith(("/", os.sep)):
        # Path() would drop the slash and write a file where a folder was meant.
        raise DappleIOError(f"{path_text(path)}: ends with a slash, so names a folder; give a file name")
    if os.path.islink(path) and not os.path.exists(path):
        raise DappleIOError(f"{path_text(path)}: a symbolic link to {path_text(os.readlink(path))}, which does not "
                            "exist; dapple writes through a link only to an existing file")
    target = Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return target
    except OSError as e:
        raise DappleIOError(f"{path_text(path)}: cannot write ({e.strerror})") from None
    kind = special_kind(mode)
    if kind is not None:
        raise DappleIOError(f"{path_text(path)}: is a {kind}; dapple writes only regular files")
    return target


def _temp_beside(path: str | os.PathLike, target: Path) -> tuple[int, str]:
    """A new temporary file in ``target``'s folder (open descriptor, name),
    with ``target``'s extension (picture writers read it) and the mode a
    plain open() would give a new file (mkstemp makes it private: 0600),
    so that every output kind has one mode under one umask."""
    directory = target.parent if str(target.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=f".tmp{target.suffix}", dir=directory)
    except OSError as e:
        raise DappleIOError(f"{path_text(path)}: cannot write ({e.strerror})") from None
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.fchmod(fd, 0o666 & ~umask)
    except OSError as e:
        os.close(fd)
        _remove_quietly(tmp)
        raise DappleIOError(f"{path_text(path)}: cannot write ({e.strerror})") from None
    return fd, tmp


def check_writable(path: str | os.PathLike) -> None:
    """Fail now, as :func:`write_atomic` would later, when ``path`` cannot be
    written (a missing or read-only folder): for outputs written at the end
    of long work."""
    fd, tmp = _temp_beside(path, output_target(path))
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
    target = output_target(path)
    fd, tmp = _temp_beside(path, target)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as e:
        _remove_quietly(tmp)
        raise DappleIOError(f"{path_text(path)}: cannot write ({e.strerror})") from None
    except BaseException:
        _remove_quietly(tmp)
        raise


def write_all_atomic(outputs: list[tuple[str | os.PathLike, Callable[[str], object]]]) -> None:
    """Write several files all or none: every target is checked first, then
    each ``write(temp_path)`` fills a temporary file beside its target (with
    the target's extension), and only when all have succeeded are they
    renamed over their targets. On an error before the renames every
    temporary file is removed and no target has changed; the renames stay in
    each target's own folder, where only a vanished folder can fail one."""
    targets = [(path, output_target(path), write) for path, write in outputs]
    staged: list[tuple[str | os.PathLike, str, Path]] = []
    try:
        for path, target, write in targets:
            fd, tmp = _temp_beside(path, target)
            os.close(fd)
            staged.append((path, tmp, target))
            write(tmp)
        for path, tmp, target in staged:
            try:
                os.replace(tmp, target)
            except OSError as e:
                raise DappleIOError(f"{path_text(path)}: cannot write ({e.strerror})") from None
    except BaseException:
        for _, tmp, _ in staged:
            _remove_quietly(tmp)
        raise


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
