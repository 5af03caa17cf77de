"""The README's two set-up commands are the ones CI and newcomers run, and its quickstart and
two-host snippets run as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)]


def section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section of a markdown text (up to the next ``## ``)."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.MULTILINE | re.DOTALL)
    assert match, f"README.md has no '## {heading}' section"
    return match.group(1)


def test_ci_runs_the_readme_test_command() -> None:
    blocks = bash_blocks((ROOT / "README.md").read_text())
    install_and_demo, tests = blocks[0], blocks[1]
    assert "p2pcoll launch -n 4 -- python examples/allreduce_demo.py" in install_and_demo
    assert "pytest" in tests
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert tests in ci_lines, f"{tests!r} must appear verbatim as a line of .ci/run"


def test_ci_runs_the_readme_install_command_and_checks_the_wheel() -> None:
    install_and_demo = bash_blocks((ROOT / "README.md").read_text())[0]
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert install_and_demo in ci_lines, f"{install_and_demo!r} must be a line of .ci/run"
    assert "bash .ci/check-wheel" in ci_lines
    assert ci_lines.index("bash .ci/check-wheel") < ci_lines.index(
        bash_blocks((ROOT / "README.md").read_text())[1]
    ), "the README's test command must stay the last thing .ci/run does"


def quickstart_script() -> str:
    """The python block of the README's "Quickstart" (``hello.py``)."""
    blocks = re.findall(r"```python\n(.*?)```", section((ROOT / "README.md").read_text(),
                                                        "Quickstart"), flags=re.DOTALL)
    assert blocks, "the Quickstart section has no python block"
    return blocks[0]


def test_quickstart_runs(tmp_path: Path) -> None:
    """The Quickstart's script, run as written by two peers of the launcher."""
    script = tmp_path / "hello.py"
    script.write_text(quickstart_script())
    done = subprocess.run(
        [sys.executable, "-m", "p2pcoll", "launch", "-n", "2", "--",
         sys.executable, str(script)],
        check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    # Each rank printed its rank, the world size and its stats.
    for rank in (0, 1):
        assert re.search(rf"^\[{rank}\] {rank} 2 \{{", done.stdout, flags=re.MULTILINE), done.stdout


def test_blocking_snippet_runs(tmp_path: Path) -> None:
    """The API section's blocking example, run as written by two peers of the launcher."""
    blocks = re.findall(r"```python\n(.*?)```", section((ROOT / "README.md").read_text(),
                                                        "The API"), flags=re.DOTALL)
    script = tmp_path / "blocking.py"
    script.write_text(next(b for b in blocks if "p2pcoll.blocking.join(" in b))
    done = subprocess.run(
        [sys.executable, "-m", "p2pcoll", "launch", "-n", "2", "--",
         sys.executable, str(script)],
        check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    for rank in (0, 1):
        line = rf"^\[{rank}\] {rank} \[1\. 1\. 1\. 1\.\] \[2\. 2\. 2\. 2\.\] True$"
        assert re.search(line, done.stdout, flags=re.MULTILINE), done.stdout


def test_two_hosts_commands_run(tmp_path: Path) -> None:
    """The "Two hosts" section's commands for host A and host B, run as written on this
    host (host A's address replaced by loopback, its port by a free one), with the
    section's job key made by its own keygen command."""
    from p2pcoll.transport.endpoints import free_port

    text = section((ROOT / "README.md").read_text(), "Two hosts")
    blocks = bash_blocks(text)
    keygen = next(b for b in blocks if "p2pcoll keygen job.key" in b)
    ranks = [next(line for b in blocks for line in b.splitlines() if f"RANK={r} " in line)
             for r in (0, 1)]
    assert "scp job.key" in keygen, "host A's block copies the key to host B"
    (tmp_path / "hello.py").write_text(quickstart_script())
    done = subprocess.run([sys.executable, "-m", "p2pcoll", "keygen", "job.key"], cwd=tmp_path,
                          check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    address = re.search(r"tcp://([0-9.]+):(\d+)", ranks[0])
    assert address and address.group(0) in ranks[1], "both hosts name host A's rendezvous"
    here = f"tcp://127.0.0.1:{free_port()}"
    commands = [line.replace(address.group(0), here).replace(" python ", f" {sys.executable} ")
                for line in ranks]
    peers = [subprocess.Popen(["bash", "-c", command], cwd=tmp_path, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for command in commands]
    try:
        outputs = [peer.communicate(timeout=120) for peer in peers]
    finally:
        for peer in peers:
            if peer.poll() is None:
                peer.kill()
                peer.wait()
    for rank, (peer, (out, err)) in enumerate(zip(peers, outputs, strict=True)):
        assert peer.returncode == 0, f"rank {rank}: exit {peer.returncode}\n{out}\n{err}"
        assert re.search(rf"^{rank} 2 \{{", out, flags=re.MULTILINE), out


def test_readme_names_every_builtin_strategy() -> None:
    import p2pcoll

    text = (ROOT / "README.md").read_text()
    for collective, names in p2pcoll.available_strategies().items():
        for name in names:
            if name == "direct":  # the example plugin, documented in its own README
                continue
            assert f"`{name}`" in text, f"README does not mention {collective} strategy {name}"


def test_how_it_is_built_names_every_folder() -> None:
    """The README's "How it is built" names every subpackage of p2pcoll."""
    text = section((ROOT / "README.md").read_text(), "How it is built")
    package = ROOT / "p2pcoll"
    for folder in sorted(p for p in package.iterdir() if p.is_dir() and p.name != "__pycache__"):
        assert f"`{folder.name}/`" in text, f"README's 'How it is built' lacks {folder.name}/"
