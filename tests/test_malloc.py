"""The transport's memory fast path: the allocator thresholds."""

from __future__ import annotations

import pytest

from p2pcoll.transport import malloc
from p2pcoll.transport.malloc import tune_malloc


def test_tune_malloc_is_idempotent_and_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(malloc, "_tuned", False)
    assert tune_malloc(False) is False
    first = tune_malloc()
    assert tune_malloc() is first
    try:
        import ctypes

        ctypes.CDLL(None).mallopt  # noqa: B018 - glibc exposes it
    except AttributeError:
        assert first is False
    else:
        assert first is True
