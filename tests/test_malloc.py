"""The transport's memory fast path: the allocator thresholds."""

from __future__ import annotations

import pytest

from p2pcoll.transport import memory
from p2pcoll.transport.memory import tune_malloc


def test_tune_malloc_is_idempotent_and_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_tuned", False)
    monkeypatch.setenv("P2PCOLL_TUNE_MALLOC", "0")
    assert tune_malloc() is False
    monkeypatch.delenv("P2PCOLL_TUNE_MALLOC")
    first = tune_malloc()
    assert tune_malloc() is first
    try:
        import ctypes

        ctypes.CDLL(None).mallopt  # noqa: B018 - glibc exposes it
    except AttributeError:
        assert first is False
    else:
        assert first is True
