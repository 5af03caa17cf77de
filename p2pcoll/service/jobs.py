"""``MODULE:FUNCTION``: the job a peer service runs, found before the peer joins."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any

from ..errors import SettingsError


def load_job(spec: str) -> Any:
    """The ``async def job(group)`` that ``spec`` (``package.module:function``) names.

    The current directory is searched first, as ``python -m`` does, so ``--job
    train:job`` finds ``./train.py``.

    Raises:
        SettingsError: the spec is malformed, the module cannot be imported (with the
            import error chained), it has no such attribute, or that is not an
            ``async def`` function taking the group.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SettingsError(f"--job {spec!r} is not MODULE:FUNCTION (like train:job)",
                            name="--job", value=spec, allowed="MODULE:FUNCTION")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SettingsError(f"--job {spec!r}: cannot import {module_name!r}: {exc}",
                            name="--job", value=spec, allowed="an importable module") from exc
    target: Any = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise SettingsError(f"--job {spec!r}: module {module_name!r} has no {attr!r}",
                                name="--job", value=spec,
                                allowed="a function of that module") from None
    if not inspect.iscoroutinefunction(target):
        raise SettingsError(
            f"--job {spec!r}: {attr!r} is a {type(target).__name__}, not an async function "
            f"(expected `async def {attr.rsplit('.', 1)[-1]}(group)`)",
            name="--job", value=spec, allowed="an async def function taking the group")
    return target
