"""How many peers wait at the rendezvous for an elastic job's next group."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ..errors import RendezvousError
from ..rendezvous.client import waiting
from ..settings import Settings
from ..transport.sockets import SocketFactory

__all__ = ["ASK_TIMEOUT_S", "Census"]

log = logging.getLogger("p2pcoll.training")

ASK_TIMEOUT_S = 1.0  # for one waiting() question


class Census:
    """Counts the peers waiting at the rendezvous for the job's next group, with the job's
    key. ``fresh()`` never waits: it asks in the background, at most every ``every`` s."""

    def __init__(self, settings: Settings, every: float) -> None:
        assert settings.rendezvous is not None
        self.url, self.job, self.every = settings.rendezvous, settings.job_id, every
        self.sockets = SocketFactory.for_settings(settings)
        self.task: asyncio.Task[int | None] | None = None
        self.due = 0.0  # loop time of the next question

    async def ask(self, expect: int | None = None) -> int | None:
        """How many wait, or None if the rendezvous did not answer; ``expect``: the group
        forming there may form once that many are there (:func:`waiting`)."""
        try:
            return await waiting(self.url, job=self.job, sockets=self.sockets,
                                 timeout=ASK_TIMEOUT_S, expect=expect)
        except RendezvousError as exc:
            log.debug("elastic: no answer from the rendezvous: %s", exc)
            return None

    def fresh(self) -> int | None:
        """The answer that came since the last call, if one did; asks again when due."""
        answer = None
        if self.task is not None and self.task.done():
            answer, self.task = self.task.result(), None
        now = asyncio.get_running_loop().time()
        if self.task is None and now >= self.due:
            self.due = now + self.every
            self.task = asyncio.create_task(self.ask())
        return answer

    async def count_into(self, counts: list[int]) -> None:
        """Append each answer to ``counts``, every ``every`` seconds, until cancelled."""
        while True:
            count = await self.ask()
            if count is not None:
                counts.append(count)
            await asyncio.sleep(self.every)

    async def aclose(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        self.sockets.close()
