"""The torch ``Work`` a p2pcoll collective returns, and its future.

``Work.wait()`` raises p2pcoll's own error (``PeerLost``, ``CollectiveTimeout``, ...,
with which rank, which collective and its sequence number); ``get_future()`` completes
with the output tensors (DDP needs them as the value) or that error.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ...errors import CollectiveTimeout
from .runtime import Completer


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
    """One collective of the p2pcoll backend, running or done."""

    def __init__(self, collective: str, outputs: list[torch.Tensor], timeout: float,
                 completer: Completer) -> None:
        super().__init__()
        self.collective = collective
        self._outputs = outputs
        self._timeout = timeout
        self._completer = completer
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future: torch.futures.Future[list[torch.Tensor]] = _Future(completer)

    def _finish(self, error: BaseException | None) -> None:
        """On the completer: record the outcome, then complete the future (whose
        callbacks run here and now)."""
        self._error = error
        self._done.set()
        if error is None:
            self._future.set_result(self._outputs)
        else:
            self._future.set_exception(error)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the collective is done; raise its error if it failed.

        ``timeout`` None or zero means the group's timeout (torch passes both).

        Raises:
            P2PCollError: what failed the collective.
            CollectiveTimeout: it was not done within ``timeout``.
        """
        limit = timeout.total_seconds() if timeout else 0.0
        if limit <= 0:
            limit = self._timeout
        if not self._done.is_set():
            self._completer.blocking()
            if not self._done.wait(None if limit == float("inf") else limit):
                raise CollectiveTimeout(
                    f"Work.wait() of {self.collective}: not done within {limit:g}s",
                    collective=self.collective,
                )
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self._future

    def result(self) -> list[torch.Tensor]:
        return self._outputs

    def synchronize(self) -> None:
        self.wait()
