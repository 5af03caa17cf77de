"""Reading and checking the values of settings: the environment reader every
``resolve`` of :mod:`p2pcoll.settings` uses, and the checks arguments share with it.

:class:`EnvReader` reads one environment (``os.environ`` or a mapping a test passes) and
returns each variable parsed and checked, or None when it is unset (or empty); a value out
of its range is a :class:`~p2pcoll.SettingsError` (made by :func:`~p2pcoll.errors.bad_value`)
naming ``$VARIABLE``, the value and what is allowed. The ``check_*`` functions apply the
same rules to a keyword argument, naming ``argument=``. Nothing here knows which
variables exist or what they default to: :mod:`p2pcoll.settings` does.

Byte counts take ``K``, ``M``, ``G`` suffixes (powers of 1024, ``KiB`` and ``KB`` alike);
switches take ``1/0``, ``true/false``, ``yes/no``, ``on/off``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from .errors import SettingsError, bad_value
from .security.keys import JobKey
from .strategy import COLLECTIVES

_SIZE = re.compile(r"\s*(\d+)\s*([KMG]?)(?:I?B)?\s*", re.IGNORECASE)
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
_JOB_ID_ALLOWED = "up to 128 letters, digits and . _ : - (starting with a letter or digit)"
# A host's name, a node's, a container's, a UUID. At most 64 characters: the identity it
# starts (see p2pcoll.transport.host_identity) must fit a rendezvous's 256-byte host field.
_HOST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
_HOST_ID_ALLOWED = ("a host name of up to 64 letters, digits and . _ : - (starting with a "
                    "letter or digit); peers with different values never share memory")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})

MIN_LINKS = 4  # a link budget leaves room for the two watched peers and a partner each way
LINKS_ALLOWED = f"0 (no bound) or an integer of at least {MIN_LINKS}"
MAX_STREAMS = 16  # stripes per peer pair, at most
STREAMS_ALLOWED = f"auto, or an integer from 1 to {MAX_STREAMS}"
DEFAULT_PIPELINE_DEPTH = 4  # segments in flight on a short link (see p2pcoll.engine.window)
MAX_PIPELINE_DEPTH = 64  # what P2PCOLL_PIPELINE_DEPTH (and the window) may reach


def parse_bytes(text: str) -> int:
    """``"64K"`` -> 65536. Raises ValueError on anything else than a count with a suffix."""
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ValueError(f"{text!r} is not a byte count (like 65536, 64K, 16M, 1G)")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


def format_bytes(n: int) -> str:
    """65536 -> ``"64K"``; the inverse of :func:`parse_bytes` for round sizes."""
    for shift, suffix in ((30, "G"), (20, "M"), (10, "K")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return str(n)


def check_seconds(value: object, where: str) -> float:
    """A deadline: a positive number of seconds (``math.inf`` for none). Returns it.

    Raises:
        SettingsError: naming ``where`` and the value (a bool, NaN, or not > 0).
    """
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    if not ok or math.isnan(value):  # type: ignore[arg-type]
        raise bad_value(where, value, "a number of seconds > 0 (math.inf for no deadline)")
    return float(value)  # type: ignore[arg-type]


def check_int(value: object, where: str, low: int, high: int | None = None) -> int:
    """An integer (not a bool) from ``low`` to ``high`` (no upper bound: None). Returns it.

    Raises:
        SettingsError: naming ``where``, the value and the span allowed.
    """
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if not ok or (high is not None and value > high):  # type: ignore[operator]
        span = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
        raise bad_value(where, value, span)
    return value  # type: ignore[return-value]


def check_streams(value: object, where: str) -> int | Literal["auto"]:
    """A stripe count (``streams``): ``"auto"`` or an integer from 1 to MAX_STREAMS."""
    if value == "auto":
        return "auto"
    if type(value) is not int or not 1 <= value <= MAX_STREAMS:
        raise bad_value(where, value, STREAMS_ALLOWED)
    return value


def check_job_id(value: object, where: str) -> None:
    """``value`` is a job id (``$P2PCOLL_JOB_ID``, ``job_id=``).

    Raises:
        SettingsError: naming ``where``, the value and what is allowed.
    """
    if not _JOB_ID.fullmatch(str(value)):
        raise bad_value(where, value, _JOB_ID_ALLOWED)


def check_host_id(value: object, where: str) -> None:
    """``value`` is a host id (``$P2PCOLL_HOST_ID``, ``host_id=``).

    Raises:
        SettingsError: naming ``where``, the value and what is allowed.
    """
    if not (isinstance(value, str) and _HOST_ID.fullmatch(value)):
        raise bad_value(where, value, _HOST_ID_ALLOWED)


def check_path(path: str, where: str) -> str:
    """``path`` if a file can be written there (its directory exists and is writable):
    the timeline's, ``p2pcoll bench --calibrate``'s cost model.

    Raises:
        SettingsError: naming ``where``, the path and what is wrong with it.
    """
    allowed = "a file path in an existing, writable directory"
    p = Path(path)
    if not path or p.name in ("", ".", ".."):
        raise SettingsError(f"{where}={path!r} is not a file path", name=where, value=path,
                            allowed=allowed)
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        raise SettingsError(f"{where}={path!r}: the directory {str(folder)!r} does not exist",
                            name=where, value=path, allowed=allowed)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SettingsError(f"{where}={path!r}: the directory {str(folder)!r} is not writable",
                            name=where, value=path, allowed=allowed)
    return path


def check_directory(path: str, where: str) -> str:
    """``path`` if it is an existing, writable directory (``$P2PCOLL_FLIGHT_DIR``).

    Raises:
        SettingsError: naming ``where``, the path and what is wrong with it.
    """
    allowed = "an existing, writable directory"
    if not os.path.isdir(path):
        raise SettingsError(f"{where}={path!r} is not an existing directory", name=where,
                            value=path, allowed=allowed)
    if not os.access(path, os.W_OK | os.X_OK):
        raise SettingsError(f"{where}={path!r}: the directory is not writable", name=where,
                            value=path, allowed=allowed)
    return path


def _float(value: str) -> float:
    """``value`` as a float; NaN, which every range check refuses, when it is not one."""
    try:
        return float(value)
    except ValueError:
        return math.nan


class EnvReader:
    """Reads and checks one environment; every method returns None for an unset (or empty)
    variable and raises :class:`~p2pcoll.SettingsError`, naming ``$VARIABLE``, for a value
    it does not allow."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env

    def raw(self, name: str) -> str | None:
        value = self.env.get(name)
        return None if value is None or value.strip() == "" else value.strip()

    def path(self, name: str) -> str | None:
        """A path a file will be written to (its directory must exist and be writable)."""
        value = self.raw(name)
        return None if value is None else check_path(value, f"${name}")

    def directory(self, name: str) -> str | None:
        """A directory files will be written to (it must exist and be writable)."""
        value = self.raw(name)
        return None if value is None else check_directory(value, f"${name}")

    def choice(self, name: str, allowed: tuple[str, ...]) -> str | None:
        value = self.raw(name)
        if value is not None and value not in allowed:
            raise bad_value(f"${name}", value, f"one of {', '.join(allowed)}")
        return value

    def seconds(self, name: str) -> float | None:
        value = self.raw(name)
        if value is None:
            return None
        number = _float(value)
        if not number > 0:
            raise bad_value(f"${name}", value, "a number of seconds > 0 (inf for none)")
        return number

    def number(self, name: str, *, unit: str = "", zero_ok: bool = False) -> float | None:
        """A finite number > 0 (>= 0 with ``zero_ok``), or None when unset."""
        value = self.raw(name)
        if value is None:
            return None
        number = _float(value)
        if not (0 <= number < math.inf and (zero_ok or number > 0)):
            of = f" of {unit}" if unit else ""
            raise bad_value(f"${name}", value,
                            f"a finite number{of} {'>=' if zero_ok else '>'} 0")
        return number

    def links(self, name: str) -> int | None:
        """A link budget: 0, or an integer of at least MIN_LINKS."""
        number = self.integer(name, 0, 1 << 20, allowed=LINKS_ALLOWED)
        if number is not None and 0 < number < MIN_LINKS:
            raise bad_value(f"${name}", self.raw(name), LINKS_ALLOWED)
        return number

    def streams(self, name: str) -> int | Literal["auto"] | None:
        """A stripe count: ``auto``, or an integer from 1 to MAX_STREAMS."""
        value = self.raw(name)
        if value is None or value.lower() == "auto":
            return None if value is None else "auto"
        return self.integer(name, 1, MAX_STREAMS, allowed=STREAMS_ALLOWED)

    def integer(self, name: str, low: int, high: int, *, allowed: str = "") -> int | None:
        """An integer from ``low`` to ``high``, or None when unset; ``allowed`` says what
        the error names as allowed (by default that span)."""
        value = self.raw(name)
        if value is None:
            return None
        try:
            number = int(value)
        except ValueError:
            number = low - 1
        if not low <= number <= high:
            raise bad_value(f"${name}", value,
                            allowed or f"an integer from {low} to {high}")
        return number

    def size(self, name: str, minimum: int) -> int | None:
        value = self.raw(name)
        if value is None:
            return None
        try:
            number = parse_bytes(value)
        except ValueError:
            number = -1
        if number < minimum:
            raise bad_value(
                f"${name}", value, f"a byte count >= {format_bytes(minimum)} (like 64K, 16M)"
            )
        return number

    def switch(self, name: str) -> bool | None:
        value = self.raw(name)
        if value is None:
            return None
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
        raise bad_value(f"${name}", value, "1 or 0 (true/false, yes/no, on/off)")

    def key(self) -> JobKey | None:
        path = self.raw("P2PCOLL_KEY_FILE")
        return None if path is None else JobKey.load(path, where="$P2PCOLL_KEY_FILE=")

    def job_id(self) -> str | None:
        value = self.raw("P2PCOLL_JOB_ID")
        if value is not None:
            check_job_id(value, "$P2PCOLL_JOB_ID")
        return value

    def host_id(self) -> str | None:
        value = self.raw("P2PCOLL_HOST_ID")
        if value is not None:
            check_host_id(value, "$P2PCOLL_HOST_ID")
        return value

    def strategies(self) -> dict[str, str]:
        out = {}
        for coll in COLLECTIVES:
            name = f"P2PCOLL_{coll.upper()}"
            value = self.raw(name)
            if value is not None:
                out[coll] = value  # installed? checked where the plugins load (api.join)
        return out


