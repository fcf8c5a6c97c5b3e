"""Atomic file writes (a reader, or a kill mid-write, sees the old file or the new one, never half) and
exclusive file locks."""
from __future__ import annotations

import errno
import os
import tempfile
import warnings
from pathlib import Path
from typing import Callable


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` on a temporary file beside ``path``, then rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes owner-only files; give the usual permissions
        _fsync(tmp)  # the bytes on disk before the name points at them, so a crash cannot leave an empty file
        os.replace(tmp, path)
        _fsync(path.parent)  # and the rename itself
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def writable_folder(path, what: str) -> Path:
    """Make folder ``path`` (and its parents) and check that a file can be written in it, before the
    work whose results go there; a ValueError naming ``what`` (the option) otherwise."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {path} is a file; it must be a folder (made if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path, prefix=".write-check-")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot write there ({e.strerror or e})") from None
    return path


def atomic_write_text(path, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)

    atomic_write(path, write)


# flock's answers where the file system has no locks (Lustre's noflock, NFS without lockd)
_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


class FileLock:
    """An exclusive fcntl lock on ``path`` (created if absent), held from ``acquire`` to ``release`` (or
    while in a ``with``); the system drops it when the process dies, however it dies. Where no lock
    can be had (no fcntl; warned: a file system without locks, a lock file that cannot be opened)
    ``acquire`` returns True and ``held`` is False."""

    def __init__(self, path, *, blocking: bool = True, warn: bool = True):
        self.path, self.blocking, self.warn, self.fd = Path(path), blocking, warn, None

    def acquire(self) -> bool:
        """Take the lock (waiting for it when blocking); False if another process holds it."""
        try:
            import fcntl
        except ImportError:
            return True
        cloexec = getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | cloexec, 0o666)
        except OSError as e:  # a read-only mount, another user's folder: an existing file locks read-only
            if e.errno not in (errno.EACCES, errno.EROFS, errno.EPERM):
                raise
            try:
                fd = os.open(self.path, os.O_RDONLY | cloexec)
            except OSError:
                return self._without(e)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if self.blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return False
        except OSError as e:
            os.close(fd)
            if e.errno not in _NO_LOCKS:
                raise
            return self._without(e)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        try:  # who holds it, for the message of whoever finds it held; best effort (a full disk)
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError:
            pass
        return True

    def _without(self, e: OSError) -> bool:
        """Go on without the lock (where none can be had), warned."""
        if self.warn:
            warnings.warn(f"{self.path.parent}: no file lock can be had here ({e.strerror}); going on without it",
                          stacklevel=3)
        return True

    @property
    def held(self) -> bool:
        """Whether this object holds the lock (False after a no-lock file system let it go on without)."""
        return self.fd is not None

    def holder(self) -> str:
        """'pid N' of the process that wrote the lock file last (the holder, while it is held)."""
        try:
            pid = self.path.read_text().strip()
        except OSError:
            pid = ""
        return f"pid {pid}" if pid.isdigit() else "another process"

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing releases the lock
            self.fd = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()
        return False
