"""Reading a peer process's memory in one copy (Linux cross-memory attach).

``process_vm_readv(2)`` copies straight from another process's address space into this
one's: one copy where shared memory needs two (the sender's into the shared file, the
receiver's out of it). The kernel allows it where it would allow ``ptrace``: the same user
and, under Yama's ``ptrace_scope`` 1 or more, not between sibling processes; so a caller
first proves it works against each peer (:func:`read` of a word the peer published) and
keeps shared memory otherwise. Only peers of one host that trust each other (a group's
authenticated members) use it; the addresses come from them, and what is read is bounded
by this process's own buffer.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys

import numpy as np


class _IOVec(ctypes.Structure):
    _fields_ = (("base", ctypes.c_void_p), ("len", ctypes.c_size_t))


def _syscall() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = (ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                   ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong)
    return fn


_readv = _syscall()


def available() -> bool:
    """Whether this platform has ``process_vm_readv`` at all (whether a given peer may be
    read is for :func:`read` to find out)."""
    return _readv is not None


def read(pid: int, address: int, into: np.ndarray) -> None:
    """Copy ``into.nbytes`` bytes at ``address`` of process ``pid`` into ``into`` (a
    C-contiguous array of this process). The GIL is released while the kernel copies.

    Raises:
        OSError: the read failed or came up short (``errno``: ESRCH, the process is gone;
            EPERM, not allowed; EFAULT, not mapped there; ENOSYS, no such call here).
    """
    if _readv is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not available here")
    n = into.nbytes
    done = 0
    local, remote = _IOVec(), _IOVec()
    base = into.ctypes.data
    while done < n:
        local.base, local.len = base + done, n - done
        remote.base, remote.len = address + done, n - done
        got = _readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            code = ctypes.get_errno() if got < 0 else errno.EFAULT
            raise OSError(code, f"reading {n} bytes of process {pid}: {os.strerror(code)}")
        done += got


__all__ = ["available", "read"]
