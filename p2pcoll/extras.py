"""The optional extras of ``pip install 'p2pcoll[EXTRA]'``, and the one error a missing one
gives: :class:`MissingExtra`, whose message says what needed which module and which extra
brings it, on one line::

    p2pcoll simulate --plot needs matplotlib, which is not installed: pip install 'p2pcoll[bench]'

Every optional import goes through here: :func:`require` checks ahead (without importing)
where a command can refuse before it starts anything, and :func:`needs` turns the
``ModuleNotFoundError`` of an import inside it into a :class:`MissingExtra`. The core
(pyzmq, msgpack, numpy) is never optional.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

# The extra to install for each optional module (where two extras bring one, the smaller).
PROVIDED_BY = {
    "aiohttp": "service",
    "prometheus_client": "service",
    "torch": "torch",
    "matplotlib": "bench",
    "mpi4py": "mpi",
    "ray": "ray",
    "sklearn": "examples",
    "tqdm": "examples",
}


def install_command(extra: str) -> str:
    """``pip install 'p2pcoll[EXTRA]'``."""
    return f"pip install 'p2pcoll[{extra}]'"


class MissingExtra(ModuleNotFoundError):
    """An optional module is not installed; the message names who needed it and the extra
    to install. A ``ModuleNotFoundError``, so ``except ImportError`` still catches it.

    Attributes:
        purpose: what needed it (``p2pcoll peer --metrics-port``).
        extra: the extra that brings it (``service``).
    """

    def __init__(self, purpose: str, module: str, extra: str) -> None:
        super().__init__(f"{purpose} needs {module}, which is not installed: "
                         f"{install_command(extra)}", name=module)
        self.purpose = purpose
        self.extra = extra


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, found without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: sys.modules[module] is None
        return False


def require(purpose: str, *modules: str) -> None:
    """Check ahead that ``modules`` (keys of :data:`PROVIDED_BY`) are installed.

    Raises:
        MissingExtra: for the first that is not.
    """
    for module in modules:
        if not installed(module):
            raise MissingExtra(purpose, module, PROVIDED_BY[module])


@contextmanager
def needs(purpose: str) -> Iterator[None]:
    """Run imports (or code that imports) inside; an optional module missing there is
    raised as a :class:`MissingExtra` for ``purpose``.

    Raises:
        MissingExtra: a module of :data:`PROVIDED_BY` (or one of its submodules) is not
            installed. Any other ModuleNotFoundError passes unchanged.
    """
    try:
        yield
    except MissingExtra:
        raise
    except ModuleNotFoundError as exc:
        top = (exc.name or "").partition(".")[0]
        if top not in PROVIDED_BY:
            raise
        raise MissingExtra(purpose, top, PROVIDED_BY[top]) from None
