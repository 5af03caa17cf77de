"""The ``p2pcoll`` command line, as the console script, as ``python -m p2pcoll`` and in-process."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import p2pcoll
from p2pcoll.cli import main
from p2pcoll.registry import DEFAULTS, registry
from p2pcoll.testing import free_port

ROOT = Path(__file__).resolve().parents[1]


def console_script() -> str:
    """The installed ``p2pcoll`` script of this interpreter (``pip install -e .`` made it)."""
    script = shutil.which("p2pcoll", path=str(Path(sys.executable).parent)) or shutil.which(
        "p2pcoll"
    )
    assert script is not None, "no p2pcoll console script: run `pip install -e .` first"
    return script


def run(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def strategy_sections(text: str) -> dict[str, list[str]]:
    """``p2pcoll strategies`` output -> {collective: [strategy names]}."""
    sections: dict[str, list[str]] = {}
    current = ""
    for line in text.splitlines():
        if header := re.fullmatch(r"(\w+) \(auto: .*\)", line):
            current = header.group(1)
            sections[current] = []
        elif name := re.match(r"  (\w+)  ", line):
            sections[current].append(name.group(1))
    return sections


def test_strategies_from_console_script_and_module_agree() -> None:
    script = run(console_script(), "strategies")
    module = run(sys.executable, "-m", "p2pcoll", "strategies")
    assert script.returncode == module.returncode == 0, script.stderr + module.stderr
    assert script.stdout == module.stdout
    assert strategy_sections(script.stdout) == p2pcoll.available_strategies()


def test_strategies_say_what_auto_picks_and_where_each_comes_from(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["strategies"]) == 0
    out = capsys.readouterr().out
    available = p2pcoll.available_strategies()
    for collective, names in available.items():
        header = next(line for line in out.splitlines() if line.startswith(f"{collective} ("))
        if DEFAULTS[collective] in names:
            assert DEFAULTS[collective] in header
    # each strategy: its description, then where it comes from
    for table in registry.entries().values():
        for name, entry in table.items():
            description = type(entry.strategy).description
            pattern = rf"^  {name} +{re.escape(description)}\n +from {re.escape(entry.origin)}$"
            assert re.search(pattern, out, re.MULTILINE), name
    assert f"from p2pcoll {p2pcoll.__version__}: p2pcoll_plugins.ring:RingAllreduce" in out


@pytest.mark.parametrize("subcommand", ["launch", "strategies", "rendezvous", "bench"])
def test_help_of_every_subcommand(subcommand: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([subcommand, "--help"]) == 0
    assert capsys.readouterr().out.startswith(f"usage: p2pcoll {subcommand} ")


def test_help_and_version_are_the_same_from_script_and_module() -> None:
    for args in (["--help"], ["launch", "--help"], ["--version"]):
        script = run(console_script(), *args)
        module = run(sys.executable, "-m", "p2pcoll", *args)
        assert script.returncode == module.returncode == 0
        assert script.stdout == module.stdout
    assert module.stdout == f"p2pcoll {p2pcoll.__version__}\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "usage: p2pcoll"),
        (["launch", "-n", "2"], "no command given"),
        (["launch", "-n", "0", "--", "true"], "must be at least 1"),
        (["launch", "-n", "2", "-c", "x"], "put the command after --"),
        (["launch", "-n", "1", "--rendezvous", "http://h:1", "--", "true"], "tcp://HOST:PORT"),
        (["strategies", "--bogus"], "unrecognized arguments: --bogus"),
        (["rendezvous", "--port", "70000"], "not a TCP port"),
        (["nonsense"], "invalid choice"),
    ],
)
def test_usage_errors_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.processes
def test_launch_takes_the_command_with_or_without_separator(
    capfd: pytest.CaptureFixture[str],
) -> None:
    hello = "import os; print('hello from', os.environ['RANK'])"
    assert main(["launch", "-n", "2", sys.executable, "-c", hello]) == 0
    assert sorted(capfd.readouterr().out.splitlines()) == ["[0] hello from 0", "[1] hello from 1"]
    assert main(["launch", "-n", "2", "--no-prefix", "--", sys.executable, "-c", hello]) == 0
    assert sorted(capfd.readouterr().out.splitlines()) == ["hello from 0", "hello from 1"]


def test_bench_that_cannot_be_imported_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delattr(p2pcoll, "bench", raising=False)
    monkeypatch.setitem(sys.modules, "p2pcoll.bench", None)  # makes the import fail
    assert main(["bench", "--collective", "allreduce"]) == 2
    assert "p2pcoll bench is not available" in capsys.readouterr().err


JOIN_AND_SUM = """
import asyncio, os
import numpy as np
import p2pcoll

async def main():
    async with p2pcoll.join(collective_timeout=30) as g:
        total = await g.allreduce(np.full(3, g.rank + 1.0))
        print(g.rank, g.world_size, total.tolist())

asyncio.run(main())
"""


@pytest.mark.processes
def test_standalone_rendezvous_server(tmp_path: Path) -> None:
    port = free_port()
    key = tmp_path / "job.key"
    assert run(sys.executable, "-m", "p2pcoll", "keygen", str(key)).returncode == 0
    env = {**os.environ, "P2PCOLL_KEY_FILE": str(key)}
    server = subprocess.Popen(
        [sys.executable, "-m", "p2pcoll", "rendezvous", "--host", "127.0.0.1", "--port",
         str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
    )
    try:
        assert server.stdout is not None
        banner = server.stdout.readline()
        assert banner.startswith(f"p2pcoll rendezvous: serving at tcp://127.0.0.1:{port}, "
                                 f"secured with the job key of {key}")
        # The ranks meet at the server (rank 0 finds the port taken and does not host),
        # twice: the server forms one group after the other. The launcher passes the job
        # key it was given on to the ranks.
        for _ in range(2):
            peers = subprocess.run(
                [sys.executable, "-m", "p2pcoll", "launch", "-n", "3", "--rendezvous",
                 f"tcp://127.0.0.1:{port}", "--", sys.executable, "-c", JOIN_AND_SUM],
                capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
            assert peers.returncode == 0, peers.stdout + peers.stderr
            want = np.full(3, 1.0 + 2.0 + 3.0).tolist()
            assert sorted(peers.stdout.splitlines()) == [f"[{r}] {r} 3 {want}"
                                                         for r in range(3)]
        # A peer without the key is turned away at the handshake.
        async def join_without_key() -> None:
            group = await p2pcoll.join(f"tcp://127.0.0.1:{port}", world_size=3, timeout=10)
            await group.close()

        with pytest.raises(p2pcoll.RendezvousError, match="has no job key"):
            asyncio.run(join_without_key())
        server.send_signal(signal.SIGTERM)
        out, err = server.communicate(timeout=10)
        assert server.returncode == 0, err
        assert "p2pcoll rendezvous: stopped" in out
    finally:
        server.kill()
        server.communicate()


@pytest.mark.processes
def test_standalone_rendezvous_reads_its_bounds() -> None:
    """`p2pcoll rendezvous` applies $P2PCOLL_RENDEZVOUS_*: a join over a bound is refused
    naming it, and a bad value stops the server before it listens."""
    bad = subprocess.run(
        [sys.executable, "-m", "p2pcoll", "rendezvous", "--port", str(free_port())],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={**os.environ, "P2PCOLL_RENDEZVOUS_MAX_JOBS": "0"})
    assert bad.returncode == 2 and "P2PCOLL_RENDEZVOUS_MAX_JOBS" in bad.stderr, bad.stderr
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "p2pcoll", "rendezvous", "--host", "127.0.0.1", "--port",
         str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "P2PCOLL_RENDEZVOUS_MAX_WORLD_SIZE": "2"})
    try:
        assert server.stdout is not None
        assert server.stdout.readline().startswith("p2pcoll rendezvous: serving at")

        async def join_three() -> None:
            group = await p2pcoll.join(f"tcp://127.0.0.1:{port}", world_size=3, timeout=10)
            await group.close()

        with pytest.raises(p2pcoll.RendezvousError, match="P2PCOLL_RENDEZVOUS_MAX_WORLD_SIZE"):
            asyncio.run(join_three())
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=10)
