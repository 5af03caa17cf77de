"""The extras coexist with what the user has: ranges in pyproject.toml, the exact tested
versions in constraints.txt (which CI exports as PIP_CONSTRAINT), and every extra's range
admitting its tested version; and a missing extra named, with what installs it, by
every command that needs one."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from p2pcoll.cli import main
from p2pcoll.extras import MissingExtra, needs, require
from p2pcoll.service import Peer

ROOT = Path(__file__).resolve().parents[1]


def extras() -> dict[str, list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {name: [Requirement(r) for r in reqs]
            for name, reqs in project["optional-dependencies"].items()}


def constraints() -> dict[str, Requirement]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            assert not req.extras, f"constraints.txt: {line!r} (pip takes no extras there)"
            pins[canonicalize_name(req.name)] = req
    return pins


def test_no_extra_pins_an_exact_version() -> None:
    for extra, reqs in extras().items():
        for req in reqs:
            exact = [s for s in req.specifier if s.operator in ("==", "===")]
            assert not exact, f"extra {extra!r} pins {req} (a range belongs there)"


def test_every_extra_admits_its_tested_version() -> None:
    pins = constraints()
    for extra, reqs in extras().items():
        for req in reqs:
            if canonicalize_name(req.name) == "p2pcoll":
                continue
            pin = pins.get(canonicalize_name(req.name))
            assert pin is not None, f"{req.name} (extra {extra!r}) has no line in constraints.txt"
            (spec,) = pin.specifier
            assert spec.operator == "==", f"constraints.txt: {pin} is not an exact version"
            assert req.specifier.contains(spec.version, prereleases=True), (
                f"extra {extra!r}: {req} excludes the tested {pin}")


def test_dev_pulls_every_other_extra() -> None:
    # `pip install -e '.[dev]'` is all the test suite needs.
    everything = extras()
    (own,) = [r for r in everything["dev"] if canonicalize_name(r.name) == "p2pcoll"]
    assert set(everything) - {"dev", "bench"} <= own.extras


# --- a missing extra says which one to install ----------------------------------------------

SERVICE = "pip install 'p2pcoll[service]'"


def first_line(text: str) -> str:
    return text.strip().splitlines()[0]


def test_needs_names_the_extra_of_a_missing_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "aiohttp", None)
    with pytest.raises(MissingExtra) as caught, needs("this demo"):
        import aiohttp.web  # noqa: F401
    assert str(caught.value) == f"this demo needs aiohttp, which is not installed: {SERVICE}"
    assert caught.value.extra == "service" and caught.value.name == "aiohttp"


def test_needs_passes_other_missing_modules_on_unchanged() -> None:
    with pytest.raises(ModuleNotFoundError) as caught, needs("this demo"):
        import no_such_module_of_p2pcoll  # type: ignore[import-not-found]  # noqa: F401
    assert not isinstance(caught.value, MissingExtra)


def test_require_checks_without_importing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "tqdm", raising=False)
    require("x", "tqdm")  # installed by dev (the examples extra)
    assert "tqdm" not in sys.modules
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(MissingExtra, match=r"^x needs prometheus_client, .*p2pcoll\[service\]"):
        require("x", "prometheus_client")


def test_peer_without_the_service_extra(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "aiohttp", None)  # as if it were not installed
    assert main(["peer", "--job", "nowhere:job", "--metrics-port", "0"]) == 2
    assert first_line(capsys.readouterr().err) == (
        "p2pcoll: p2pcoll peer's metrics port (--metrics-port, $P2PCOLL_METRICS_PORT) needs "
        f"aiohttp, which is not installed: {SERVICE}")


async def test_service_peer_without_the_service_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "aiohttp", None)
    monkeypatch.delitem(sys.modules, "p2pcoll.service.http", raising=False)
    with pytest.raises(MissingExtra, match=r"^p2pcoll.service.Peer's metrics port "
                                           r"\(metrics_port=\) needs aiohttp"):
        await Peer(metrics_port=0).start()


def test_simulate_plot_without_matplotlib(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delitem(sys.modules, "matplotlib.figure", raising=False)
    assert main(["simulate", "-n", "2", "--plot", str(tmp_path / "x.png")]) == 2
    assert first_line(capsys.readouterr().err) == (
        "p2pcoll: p2pcoll simulate --plot needs matplotlib, which is not installed: "
        "pip install 'p2pcoll[bench]'")


def block(monkeypatch: pytest.MonkeyPatch, top: str, *importers: str) -> None:
    """Import ``top`` (and its submodules) as if it were not installed, and forget the
    p2pcoll modules ``importers`` (and their submodules) so that importing them runs again."""
    monkeypatch.setitem(sys.modules, top, None)
    for name in [n for n in sys.modules if n.startswith(f"{top}.")]:
        monkeypatch.setitem(sys.modules, name, None)
    for name in [n for n in sys.modules if n in importers or n.startswith(importers)]:
        monkeypatch.delitem(sys.modules, name)


TORCH = ("p2pcoll's torch.distributed backend (p2pcoll.torch) needs torch, which is not "
         "installed: pip install 'p2pcoll[torch]'")


@pytest.mark.parametrize("module", ["p2pcoll.torch", "p2pcoll.integrations.torch",
                                    "p2pcoll.integrations.torch.hooks"])
def test_torch_backend_without_the_torch_extra(monkeypatch: pytest.MonkeyPatch,
                                               module: str) -> None:
    block(monkeypatch, "torch", "p2pcoll.torch", "p2pcoll.integrations.torch")
    with pytest.raises(MissingExtra) as caught:
        __import__(module)
    assert first_line(str(caught.value)) == TORCH
    assert caught.value.extra == "torch" and caught.value.name == "torch"


def test_ray_backend_without_the_ray_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    block(monkeypatch, "ray", "p2pcoll.integrations.ray")
    with pytest.raises(MissingExtra) as caught:
        import p2pcoll.integrations.ray  # noqa: F401
    assert first_line(str(caught.value)) == (
        "p2pcoll's Ray collective backend (p2pcoll.integrations.ray) needs ray, which is not "
        "installed: pip install 'p2pcoll[ray]'")
    assert caught.value.extra == "ray" and caught.value.name == "ray"
