"""Advisory file locks that let several processes (replicas) share one SSD cache directory.

Three roles, one lock per file (`flock`, released by the kernel when the holder exits, kill -9 included):

    writer   holds LOCK_EX on its `*.tmp` from creation until after the rename (`writing`): a temp file whose lock
             can be taken belongs to a dead writer and may be deleted (`abandoned`); one whose lock cannot be
             taken is a live writer's, and is left alone.
    reader   holds LOCK_SH on a `*.safetensors` file while it reads it (`reading`).
    remover  deletes a file only while holding LOCK_EX (`remove_unless_busy`): a file that a reader (of any
             process) holds is skipped, never deleted under it.

Why a reader locks at all when POSIX keeps an unlinked, open file readable: on a shared network volume (NFS) a
file deleted by another host goes stale under its reader (ESTALE). The reader re-checks after locking that the
path still names the file it locked, so a remove that won the race is a clean miss, not a read of a ghost.

flock works between processes and between open files of one process; on Linux NFS clients it is carried by
POSIX byte-range locks, which the server coordinates between hosts.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from typing import BinaryIO

__all__ = ["writing", "abandoned", "reading", "remove_unless_busy"]


def writing(f: BinaryIO) -> None:
    """Mark the just-created temp file `f` as a live writer's (held until `f` is closed)."""
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)


def abandoned(path: str) -> bool:
    """True when no live process is writing `path` (its writer died or finished): safe to delete.

    False while a writer holds it, and when the file is already gone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def reading(path: str) -> Iterator[None]:
    """Hold a shared lock on `path` while the body reads it. FileNotFoundError when the file is gone, or was
    replaced or removed while the lock was awaited (the caller treats that as a miss)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only for a remover's unlink or a writer's rename to finish
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            raise FileNotFoundError(errno.ENOENT, "removed while waiting for its lock", path)
        yield
    finally:
        os.close(fd)


def remove_unless_busy(path: str) -> bool | None:
    """Delete `path` unless a reader or writer holds it. True: deleted; False: busy, left in place; None: it was
    already gone. Other OSErrors propagate."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise
        try:
            if os.stat(path).st_ino != os.fstat(fd).st_ino:
                return None  # another remover won and a new file took the name (uuid names: never in practice)
            os.unlink(path)
            return True
        except FileNotFoundError:
            return None
    finally:
        os.close(fd)
