"""Names of a package imported on first use (PEP 562's module ``__getattr__``).

A package lists where each of its lazy names lives; :func:`lazy_names` gives it the
``__getattr__`` and ``__dir__`` that import a name's module on first read and keep the
value in the package, so later reads never come back here. Type checkers see the names
through the package's ``if TYPE_CHECKING:`` imports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, namespace: dict[str, Any], homes: Mapping[str, str],
               modules: tuple[str, ...] = ()
               ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` (its ``__name__``), whose ``namespace``
    (its ``globals()``) gets each name of ``homes`` (name -> module relative to the
    package) on first read, and each of ``modules`` (submodules) as the module itself.

    Raises (from the ``__getattr__``):
        AttributeError: a name the package does not have.
    """

    def __getattr__(name: str) -> object:
        if name in modules:
            return importlib.import_module(f".{name}", package)
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home, package), name)
        namespace[name] = value  # once: later reads find it without this hook
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *namespace.get("__all__", ())})

    return __getattr__, __dir__
