"""A run's output folder: one writer at a time, a resumable replacement, the final swap.

For `--out=runs/x` three names beside it are used (all in `runs/`):

* `.x.lock`: held (flock) by the process writing `runs/x`, naming it (PID, host). A
  second writer is refused with that name; a lock left by a killed process is taken
  over (the kernel drops a flock when its process dies).
* `.x.new`: with `--overwrite` the new run is built here, so that `runs/x` stays
  intact until the new run is whole, and a killed `--overwrite` run resumes here.
* `.x.old`: the old folder for the instant of the swap, then removed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket

try:
    import fcntl
except ImportError:  # not POSIX: the PID check below is the lock
    fcntl = None


class FolderLockedError(RuntimeError):
    """Another running process is writing the same output folder."""


class SweepMismatchError(RuntimeError):
    """The output folder holds a different sweep (and --overwrite was not given)."""


def _beside(out: str, suffix: str) -> str:
    out = os.path.abspath(out)  # also drops a trailing slash
    return os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.{suffix}")


def lock_path(out: str) -> str:
    return _beside(out, "lock")


def staging_path(out: str) -> str:
    """Where `--overwrite` builds the replacement of `out`."""
    return _beside(out, "new")


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _holder(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 200).decode(errors="replace").strip()


def _pid_alive(holder: str) -> bool:
    """Whether a holder line `process PID on HOST` names a live process on this host
    (used only where the filesystem has no flock)."""
    parts = holder.split()
    if len(parts) != 4 or parts[2] != "on" or parts[3] != socket.gethostname():
        return bool(holder)  # another host or an unknown format: assume it is alive
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    return True


def _try_flock(fd: int, path: str) -> bool:
    """True when this process now holds the lock on `path` through `fd`."""
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as e:  # a filesystem without flock (some network/FUSE mounts)
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            return not _pid_alive(_holder(fd))
        return True
    return not _pid_alive(_holder(fd))


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def locked(out: str, log=print):
    """Holds the write lock of folder `out` for the block; FolderLockedError if another
    live process holds it (the message names it). Creates `out`'s parent folder."""
    path = lock_path(out)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        if not _try_flock(fd, path):
            holder = _holder(fd) or "another process"
            os.close(fd)
            raise FolderLockedError(
                f"output folder {out!r} is being written by {holder}; wait for it to "
                f"finish or stop it (lock file {path}). Nothing was changed."
            )
        # the holder may have removed the file between our open and our lock: retry
        if _same_file(fd, path):
            break
        os.close(fd)
    stale = _holder(fd)
    if stale:
        log(f"{out}: taking over the lock left by {stale}, which is no longer running")
    os.ftruncate(fd, 0)
    os.write(fd, f"process {os.getpid()} on {socket.gethostname()}\n".encode())
    try:
        yield
    finally:
        os.unlink(path)  # while still holding it, so no one locks a removed file
        os.close(fd)


def check_usable(out: str) -> None:
    """Refuses an `out` that cannot be a folder (a regular file), before any compute."""
    if os.path.lexists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out!r} is a file, not a folder; choose another --out")


def prepare(out: str, difference, overwrite: bool) -> tuple[str, bool]:
    """(folder to train in, whether it already holds the finished run); call it locked.

    `difference(folder)` is None when a folder holds this run (finished or not), else
    what it holds instead (for the message). Without `overwrite`: `out` when it is
    missing or empty or holds this run (resume); SweepMismatchError when it holds
    anything else. With `overwrite`: the staging folder, resumed when it holds this run
    (an interrupted `--overwrite`), else emptied: the user asked for a fresh run even
    if `out` holds this one finished.
    """
    check_usable(out)
    staging = staging_path(out)
    if overwrite:
        if os.path.isdir(staging) and difference(staging) is None:
            return staging, is_finished(staging)
        _remove(staging)
        return staging, False
    if not os.path.exists(out) or not os.listdir(out):
        return out, False
    what = difference(out)
    if what is None:
        return out, is_finished(out)
    hint = ""
    if os.path.isdir(staging) and difference(staging) is None:
        hint = "; an interrupted --overwrite run of this sweep is waiting, --overwrite resumes it"
    raise SweepMismatchError(
        f"output folder {out!r} holds {what}; pass --overwrite to replace it or choose "
        f"another --out (nothing was changed){hint}"
    )


def is_finished(folder: str) -> bool:
    """results.csv is written last (atomically): its presence marks a finished run."""
    return os.path.isfile(os.path.join(folder, "results.csv"))


def publish(work: str, out: str) -> None:
    """Puts a finished `work` folder in place of `out` (a no-op when they are the same).

    The old `out` is moved aside first and removed last, so a crash in between leaves
    the finished run in the staging folder, where the next `--overwrite` finds it.
    """
    if os.path.abspath(work) == os.path.abspath(out):
        return
    old = _beside(out, "old")
    _remove(old)
    if os.path.lexists(out):
        os.rename(out, old)
    os.rename(work, out)
    _remove(old)
