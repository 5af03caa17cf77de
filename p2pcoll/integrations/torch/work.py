"""The torch ``Work`` a p2pcoll collective returns, and its future.

A failed collective raises torch's error for backends,
:class:`torch.distributed.DistBackendError`, which is p2pcoll's error too (``PeerLost``,
``CollectiveTimeout``, ..., naming the rank, the collective and its sequence number; see
:func:`backend_error`): from ``Work.wait()`` (so from synchronous collectives and FSDP2)
and from its future's ``wait()``, ``value()`` and ``.then()`` callbacks. DDP reads the future
in C++, and torch 2.13 wraps whatever a Python backend or hook raises there in a
RuntimeError (the base of DistBackendError; Gloo raises a plain RuntimeError there too)
whose message carries the error: ``loss.backward()`` raises "Cannot extract tensors from
value: PeerLost: rank 0 lost the connection to rank 2 ...", or with a Python communication
hook "Got the following error when running the callback: PeerLost: ...".

``get_future()`` completes with the output tensors (DDP needs them as the value).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ...errors import CollectiveTimeout, P2PCollError
from .runtime import Completer

_BACKEND_ERRORS: dict[type[P2PCollError], type[P2PCollError]] = {}
_backend_errors_lock = threading.Lock()


def backend_error(error: BaseException) -> BaseException:
    """``error`` as the torch backend's error: p2pcoll's errors become an instance of a
    subclass of both their class and :class:`torch.distributed.DistBackendError` (so
    ``except PeerLost`` and ``except DistBackendError`` both catch it), with the same
    message and attributes, caused by ``error``; other errors are returned as they are."""
    if not isinstance(error, P2PCollError) or isinstance(error, dist.DistBackendError):
        return error
    kind = type(error)
    with _backend_errors_lock:
        both = _BACKEND_ERRORS.get(kind)
        if both is None:
            both = type(kind.__name__, (kind, dist.DistBackendError),
                        {"__module__": __name__, "__doc__": kind.__doc__,
                         "__reduce__": _reduce_backend_error})
            _BACKEND_ERRORS[kind] = both
    converted = both.__new__(both, *error.args)
    converted.args = error.args
    converted.__dict__.update(error.__dict__)
    converted.__cause__ = error
    return converted


def _reduce_backend_error(self: P2PCollError) -> tuple[Any, ...]:
    """Pickle a converted error as its p2pcoll class, args and attributes (the class made
    by :func:`backend_error` is no module attribute), converted again when unpickled."""
    kind = next(k for k in type(self).__mro__[1:] if k in _BACKEND_ERRORS)
    return (_rebuild_backend_error, (kind, self.args, dict(self.__dict__)))


def _rebuild_backend_error(kind: type[P2PCollError], args: tuple[Any, ...],
                           state: dict[str, Any]) -> BaseException:
    error = kind.__new__(kind, *args)
    error.args = args
    error.__dict__.update(state)
    return backend_error(error)


class _Failure:
    """The value of a failed collective's future, whose unwrapping raises the error.

    A torch future has no error state that Python can set: ``Future.set_exception()``
    stores the exception as the value and makes Python's ``wait()`` and ``value()`` raise
    it, while C++ reads the value: DDP's reducer takes the gradients out of it by
    pickling it (``torch._jit_internal._extract_tensors``), found none in an exception
    and indexed the empty list (the segfault of issue 20). Pickling this raises the error
    instead, so ``backward()`` raises it.
    """

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __reduce__(self) -> Any:
        raise self.error


def _raise_failure(value: _Failure) -> None:
    """The unwrapping of a failed future's value in Python (``wait()``, ``value()``)."""
    raise value.error


class _Future(torch.futures.Future):  # type: ignore[type-arg]
    """torch's future, whose ``wait()`` first hands the completer's job over when it is
    called on the completer: the PowerSGD hook waits on a nested collective's future
    from inside a ``.then()`` callback, and that future is completed by the completer."""

    def __init__(self, completer: Completer) -> None:
        super().__init__()
        self._completer = completer

    def wait(self) -> Any:
        if not self.done():
            self._completer.blocking()
        return super().wait()


class Work(dist._Work):  # type: ignore[misc]
    """One collective of the p2pcoll backend, running or done.

    Its future is made when first asked for (:meth:`get_future`). The collective's end
    settles the Work on the loop thread (:meth:`_settle`): without a future there, it is
    finished there and then (nothing else can be waiting on it but ``wait()``); with one,
    the completer finishes it, since completing the future runs its callbacks.
    """

    def __init__(self, collective: str, outputs: list[torch.Tensor], timeout: float,
                 completer: Completer) -> None:
        super().__init__()
        self.collective = collective
        self._outputs = outputs
        self._timeout = timeout
        self._completer = completer
        # Done: _finished is set, then _released released (held from here until then: a
        # lock is lighter to make and to wait on than an Event, and each waiter passes it on).
        self._finished = False
        self._released = threading.Lock()
        self._released.acquire()
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # orders get_future() against _settle()
        self._future: _Future | None = None
        self.sender: list[int] = []  # a receive from any source: its sender, once done

    def _settle(self, error: BaseException | None) -> None:
        """On the loop thread, once the collective has finished: finish the Work here if
        nobody has its future (waking ``wait()``), else hand it to the completer."""
        with self._lock:
            if self._future is None:
                self._error = None if error is None else backend_error(error)
                self._set_done()
                return
        self._completer.submit(lambda: self._finish(error))

    def _finish(self, error: BaseException | None) -> None:
        """On the completer: record the outcome, then complete the future (whose
        callbacks run here and now)."""
        self._error = None if error is None else backend_error(error)
        self._set_done()
        assert self._future is not None  # _settle() sends only Works with a future here
        self._complete(self._future)

    def _set_done(self) -> None:
        self._finished = True
        self._released.release()

    def _complete(self, future: _Future) -> None:
        if self._error is None:
            future.set_result(self._outputs)
        else:
            future._set_unwrap_func(_raise_failure)
            future.set_result(_Failure(self._error))

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the collective is done; raise its error if it failed.

        ``timeout`` None or zero means the group's timeout (torch passes both).

        Raises:
            P2PCollError: what failed the collective, as a DistBackendError too
                (:func:`backend_error`).
            CollectiveTimeout: it was not done within ``timeout`` (a DistBackendError too).
        """
        limit = timeout.total_seconds() if timeout else 0.0
        if limit <= 0:
            limit = self._timeout
        if not self._finished:
            self._completer.blocking()
            forever = limit >= threading.TIMEOUT_MAX  # inf too
            if not self._released.acquire(timeout=-1 if forever else limit):
                raise backend_error(CollectiveTimeout(
                    f"Work.wait() of {self.collective}: not done within {limit:g}s",
                    collective=self.collective,
                ))
            self._released.release()  # for the next waiter
        if self._error is not None:
            raise self._error
        return True

    def _source_rank(self) -> int:
        """The rank a receive from any source got its message from (torch asks after
        ``wait()``); -1 for anything else."""
        return self.sender[0] if self.sender else -1

    def is_completed(self) -> bool:
        return self._finished

    def is_success(self) -> bool:
        return self._finished and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """The future of the output tensors (made on the first call; complete at once if
        the Work was already finished, so callbacks added later run in the caller)."""
        with self._lock:
            if self._future is None:
                self._future = _Future(self._completer)
                if self._finished:
                    self._complete(self._future)
            return self._future

    def result(self) -> list[torch.Tensor]:
        return self._outputs

    def synchronize(self) -> None:
        self.wait()
