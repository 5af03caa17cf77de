"""Files in ``/dev/shm``: the one place that creates, maps, unlinks and closes them.

Rings (:mod:`.shm`), lanes (:mod:`.lane`) and the board (:mod:`.board`) are each one file
in ``/dev/shm`` that a peer creates and names, over the authenticated socket, to peers of
its host, which map it. This module is their common part; what is inside a file (its
header, and the checks of it) stays with each.

Creating. :meth:`ShmFile.create` makes ``p2pcoll-<pid>-<16 hex>`` (:data:`NAME`; the pid is
the creator's, so that :func:`sweep` can remove what a killed creator left), mode 0600,
exclusively and without following links, reserves its bytes (``posix_fallocate``: a full
``/dev/shm`` fails here, cleanly, instead of with SIGBUS at a later write) and maps it. On
any failure nothing is left behind.

Mapping a name a peer sent. The name is input from another process, so
:meth:`ShmFile.open` trusts nothing in it: it must be a ``str`` of at most
:data:`MAX_NAME` characters matching :data:`NAME` in full (ASCII digits and hex only: no
``/``, no ``..``, no trailing newline), which leaves only files of ``/dev/shm`` itself;
the file is opened without following a symbolic link and must be a regular file of this
user with one link whose size lies within the bounds the caller gives. Every check is O(1)
(no listing, no reading). Any failure is a :class:`~p2pcoll.errors.ProtocolError` that
says what the file was said to be (``"lane"``, ``"board"``, ...).

Unlinking. A name is needed only until every peer it was named to has mapped the file;
whoever sees that unlinks it (:meth:`ShmFile.unlink`, idempotent), and the creator does
in any case when it closes (a mapping outlives the name).
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
import threading

from ..errors import ProtocolError
from .endpoints import remove_orphans

SHM_DIR = "/dev/shm"
PAGE = 4096
# A file's name; group 1 is the pid of its creator.
NAME = re.compile(r"p2pcoll-([1-9][0-9]{0,9})-[0-9a-f]{16}")
MAX_NAME = 36  # "p2pcoll-" + 10 digits + "-" + 16 hex digits, with room to spare
MAX_FILE_BYTES = 1 << 40  # no file of ours is larger: a size beyond is refused unmapped

_barrier_lock = threading.Lock()


def barrier() -> None:
    """A full memory barrier: a lock's acquire and release both fence."""
    with _barrier_lock:
        pass


def available(directory: str | None = None) -> bool:
    """Whether this host has a shared-memory filesystem to put files in."""
    return os.path.isdir(directory or SHM_DIR)


def check_name(name: object, what: str) -> str:
    """``name`` if it is the name of one of our files, else ProtocolError naming ``what``."""
    if not isinstance(name, str) or len(name) > MAX_NAME or NAME.fullmatch(name) is None:
        shown = name[:MAX_NAME + 8] if isinstance(name, (str, bytes)) else name
        raise ProtocolError(f"{what} name {shown!r} is not one of ours")
    return name


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ShmFile:
    """One file of ``/dev/shm`` mapped into this process (see the module docstring).

    Attributes:
        name: the file's name (what goes in a hello).
        path: where it is (or was, once unlinked).
        size: its bytes, all mapped.
        map: the mapping; views of it may outlive :meth:`close` (the GC unmaps it then).
        owner: this process created it (and unlinks it at :meth:`close` at the latest).
        linked: the name is still there, as far as this process knows.
    """

    def __init__(self, name: str, path: str, buf: mmap.mmap, size: int, *,
                 owner: bool) -> None:
        self.name = name
        self.path = path
        self.map = buf
        self.size = size
        self.owner = owner
        self.linked = True
        self.closed = False

    @classmethod
    def create(cls, size: int, *, directory: str | None = None) -> ShmFile:
        """Create, reserve and map a new file of ``size`` bytes, named after this process.

        Raises:
            ValueError: ``size`` is not within 1 .. :data:`MAX_FILE_BYTES`.
            OSError: ``/dev/shm`` is missing, full or not writable (nothing is left
                behind).
        """
        if not 0 < size <= MAX_FILE_BYTES:
            raise ValueError(f"a shared-memory file of {size} bytes: must be 1 to "
                             f"{MAX_FILE_BYTES}")
        name = f"p2pcoll-{os.getpid()}-{secrets.token_hex(8)}"
        path = os.path.join(directory or SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            buf = mmap.mmap(fd, size)
        except BaseException:
            _unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(name, path, buf, size, owner=True)

    @classmethod
    def open(cls, name: object, what: str, *, min_size: int = PAGE + 1,
             max_size: int = MAX_FILE_BYTES, directory: str | None = None) -> ShmFile:
        """Map the file a peer named ``name``; the caller then checks its header.

        Args:
            name: as the peer sent it (anything at all).
            what: what the file is said to be, for the error (``"lane"``).
            min_size: the fewest bytes such a file has.
            max_size: the most bytes such a file has.
            directory: where our files are (by default :data:`SHM_DIR`).

        Raises:
            ProtocolError: not one of our names; no such file, or it cannot be opened or
                mapped; not a regular file of this user with one link; a size outside
                ``min_size`` .. ``max_size``. The message names ``what`` and ``name``.
        """
        name = check_name(name, what)
        path = os.path.join(directory or SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise ProtocolError(f"cannot map {what} {name!r}: {exc.strerror}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() \
                    or info.st_nlink != 1:
                raise ProtocolError(f"{what} {name!r} is not a {what} file of this user")
            if not min_size <= info.st_size <= max_size:
                raise ProtocolError(f"{what} {name!r} has {info.st_size} bytes, not "
                                    f"{min_size} to {max_size}")
            try:
                buf = mmap.mmap(fd, info.st_size)
            except OSError as exc:
                raise ProtocolError(f"cannot map {what} {name!r}: {exc.strerror}") from None
        finally:
            os.close(fd)
        return cls(name, path, buf, info.st_size, owner=False)

    def unlink(self) -> None:
        """Remove the name (the mappings stay); nothing if it is gone already."""
        if self.linked:
            self.linked = False
            _unlink(self.path)

    def close(self) -> None:
        """Unlink the name if this process created it, and drop this mapping (at once, or
        when the last view of it goes). Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.owner:
            self.unlink()
        try:
            self.map.close()
        except BufferError:  # a view is still alive somewhere; the GC unmaps it later
            pass


def sweep(directory: str | None = None) -> int:
    """Remove our files of ``directory`` (by default :data:`SHM_DIR`) whose creator has
    exited; how many went.

    Only files named like ours, of this user, whose creator is gone (see
    :func:`~.endpoints.remove_orphans`). A creator that only seems gone (it runs in another
    pid namespace that shares ``/dev/shm``) loses no more than the peers that had not
    mapped its file yet: they cannot, and it uses the socket for them instead.
    """
    return len(remove_orphans(directory or SHM_DIR, NAME, stat.S_ISREG))


__all__ = ["MAX_FILE_BYTES", "NAME", "PAGE", "SHM_DIR", "ShmFile", "available", "barrier",
           "check_name", "sweep"]
