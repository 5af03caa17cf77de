"""One-byte wake-ups written without letting go of the GIL.

CPython lets go of the GIL around every system call it makes for Python code
(``os.write``, ``socket.send``), and taking it back waits until the thread that took it
meanwhile lets go in turn: up to the switch interval (5 ms) while that thread runs Python.
A wake-up (one byte into a non-blocking pipe or socket) takes a microsecond in the kernel,
so where threads of one process compete for the GIL (a torch backend's loop thread against
autograd's thread, the completer and the loop against each other) it cost up to 5 ms for
nothing. :func:`write_byte` makes the same ``write(2)`` through ``ctypes.PyDLL``, which
keeps the GIL. It must only be used on descriptors that never block (``O_NONBLOCK``).
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable

_NUL = b"\0"


def _libc_write() -> Callable[[int, bytes, int], int] | None:
    """libc's ``write``, called with the GIL held; None where there is none."""
    try:
        fn = ctypes.PyDLL(None, use_errno=True).write
    except (OSError, AttributeError, TypeError):  # (TypeError: no libc by that name)
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
    return fn


_write = _libc_write()


def available() -> bool:
    """Whether :func:`write_byte` keeps the GIL here (else it is ``os.write``)."""
    return _write is not None


def write_byte(fd: int) -> None:
    """Write one zero byte into the non-blocking descriptor ``fd``, keeping the GIL.

    Raises:
        BlockingIOError: the pipe or socket is full (its reader has wake-ups waiting).
        OSError: the write failed otherwise (a closed reader: EPIPE; a bad descriptor).
    """
    if _write is None:
        os.write(fd, _NUL)
        return
    if _write(fd, _NUL, 1) < 0:
        code = ctypes.get_errno()
        if code in (errno.EAGAIN, errno.EWOULDBLOCK):
            raise BlockingIOError(code, os.strerror(code))
        raise OSError(code, os.strerror(code))


__all__ = ["available", "write_byte"]
