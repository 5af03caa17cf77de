"""The README and docs/ say what is true today: their commands run as written.

How a command is marked runnable. A fenced block whose info string is the language followed
by ``runnable`` (```` ```bash runnable ````) holds shell commands this module runs, as
written, in a scratch directory where ``examples/``, ``tests/``, ``benchmarks/`` and
``plugins/`` are the repository's; every command must exit 0. A third word puts the block in
a test tier: ```` ```bash runnable processes ```` (it starts peer processes) or
```` ```bash runnable slow ````; without one the block is cheap and runs in the default tier.
Renderers show only the language, so the mark stays invisible to readers.

The README's two set-up commands are not re-run here: CI runs them itself, and the tests
below check that ``.ci/run`` holds them verbatim, followed by the marked tiers. The
Quickstart, the blocking example and the two-host commands run through dedicated tests that
also compare what they print with what the README shows.

Tests that start peer processes carry the ``processes`` mark; the rest are cheap.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
SHARED = ("examples", "tests", "benchmarks", "plugins")  # what runnable commands may name
TIERS = {"": None, "processes": pytest.mark.processes, "slow": pytest.mark.slow}
SECONDS = {"": 60, "processes": 300, "slow": 900}  # each block's bound, by tier
MAX_README_WORDS = 3000

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", flags=re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Block:
    """One fenced block of a markdown file."""

    path: Path
    line: int
    info: str  # the whole info string: "bash runnable processes"
    body: str

    @property
    def language(self) -> str:
        return self.info.split()[0] if self.info.split() else ""

    @property
    def runnable(self) -> bool:
        return self.info.split()[1:2] == ["runnable"]

    @property
    def tier(self) -> str:
        return " ".join(self.info.split()[2:])

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    return [Block(path, text.count("\n", 0, m.start()) + 1, m.group(1).strip(), m.group(2))
            for m in FENCE.finditer(text)]


def section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section of a markdown text (up to the next ``## ``)."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.MULTILINE | re.DOTALL)
    assert match, f"no '## {heading}' section"
    return match.group(1)


def fenced(text: str, language: str) -> list[str]:
    """The bodies of the blocks of ``language`` (any further words of the info string)."""
    return [m.group(2) for m in FENCE.finditer(text) if m.group(1).split()[:1] == [language]]


def ci_lines() -> list[str]:
    return [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]


# -- the set-up commands and the tiers: what CI runs ---------------------------------------


def setup_commands() -> list[str]:
    commands = [b.strip() for b in fenced(section(README.read_text(), "Two commands"), "bash")]
    assert len(commands) == 2, f"'Two commands' must hold two bash blocks, has {commands}"
    return commands


def tier_commands() -> list[str]:
    """The test commands of the README's "Tests" table, in its order."""
    commands = re.findall(r"^\| `(python -m pytest[^`]*)` \|", section(README.read_text(), "Tests"),
                          flags=re.MULTILINE)
    assert commands, "the README's 'Tests' section has no table of pytest commands"
    return commands


def test_the_two_commands_are_the_newcomers() -> None:
    install_and_demo, tests = setup_commands()
    assert install_and_demo == (
        "pip install -e . && p2pcoll launch -n 4 -- python examples/allreduce_demo.py")
    assert tests == "pip install -e '.[dev]' -e examples/custom_strategy && python -m pytest -q"


def test_ci_runs_the_two_commands_then_every_tier() -> None:
    lines = ci_lines()
    default, *marked = tier_commands()
    assert default == "python -m pytest -q" == setup_commands()[1].split(" && ")[-1], \
        "the Tests table starts with the default tier, the one the second command runs"
    expected = [*setup_commands(), *marked]  # the default tier runs within the second
    for command in expected:
        assert command in lines, f"{command!r} must be a line of .ci/run, as the README says"
    at = [lines.index(c) for c in expected]
    assert at == sorted(at), f".ci/run must run {expected} in this order"


def test_the_tiers_are_the_registered_markers() -> None:
    """Each marked tier the README names is a marker pytest knows (pyproject.toml)."""
    known = (ROOT / "pyproject.toml").read_text()
    for command in tier_commands()[1:]:
        marker = re.fullmatch(r"python -m pytest -q -m (\w+)", command)
        assert marker, f"{command!r}: a tier runs as `python -m pytest -q -m MARKER`"
        assert f'"{marker.group(1)}: ' in known, f"marker {marker.group(1)} is not registered"
        assert marker.group(1) in TIERS, f"runnable blocks cannot name tier {marker.group(1)}"


# -- the README's shape --------------------------------------------------------------------


def test_readme_is_short() -> None:
    words = len(README.read_text().split())
    assert words <= MAX_README_WORDS, f"README.md has {words} words (at most {MAX_README_WORDS})"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_notes_about_how_it_was_written(path: Path) -> None:
    text = path.read_text()
    for stale in ("<!--", "development machine", "p2pcoll-0.", ".whl"):
        assert stale not in text, f"{path.name} still says {stale!r}"


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings (outside fenced blocks)."""
    text = FENCE.sub("", path.read_text())
    anchors = set()
    for title in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


@pytest.mark.parametrize("path", [*DOCS, ROOT / "benchmarks" / "README.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_links_lead_somewhere(path: Path) -> None:
    """Every relative link names a file that exists, and a heading of it if it names one."""
    text = FENCE.sub("", path.read_text())
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{path.name} links to {target}: no such file"
        if anchor and linked.suffix == ".md":
            assert anchor in heading_anchors(linked), f"{path.name} links to {target}: no such heading"


def test_benchmarks_index_names_every_script() -> None:
    """benchmarks/README.md's index has a line for every script in benchmarks/."""
    index = section((ROOT / "benchmarks" / "README.md").read_text(), "Index")
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        assert f"| `{script.name}` |" in index, f"benchmarks/README.md's index lacks {script.name}"


def test_readme_names_every_builtin_strategy() -> None:
    import p2pcoll

    text = README.read_text()
    for collective, names in p2pcoll.available_strategies().items():
        for name in names:
            if name == "direct":  # the example plugin, documented in its own README
                continue
            assert f"`{name}`" in text, f"README does not mention {collective} strategy {name}"


def test_readme_names_every_timeout_variable() -> None:
    """One table of the README names every variable that sets a timeout or a heartbeat."""
    from p2pcoll.settings import KNOWN_VARS

    table = section(README.read_text(), "The API").split("### Timeouts", 1)[-1]
    timing = sorted(v for v in KNOWN_VARS if "TIMEOUT" in v or "HEARTBEAT" in v)
    assert "P2PCOLL_JOIN_TIMEOUT" in timing and "P2PCOLL_TIMEOUT" in timing
    for variable in timing:
        assert f"| `{variable}` |" in table, f"README's Timeouts table lacks {variable}"


def test_api_doc_names_every_variable() -> None:
    """docs/api.md's table names every variable settings.py knows (a family by its prefix)."""
    from p2pcoll.settings import KNOWN_VARS
    from p2pcoll.strategy import COLLECTIVES

    text = (ROOT / "docs" / "api.md").read_text()
    families = ("P2PCOLL_RENDEZVOUS_", "P2PCOLL_METRICS_")
    for variable in sorted(KNOWN_VARS - {"P2PCOLL_LAUNCHED"}):
        if variable in {f"P2PCOLL_{c.upper()}" for c in COLLECTIVES}:
            assert "`P2PCOLL_<COLLECTIVE>`" in text
            continue
        family = next((f for f in families if variable.startswith(f)), None)
        if f"`{variable}`" in text:
            continue
        assert family and f"`{family}*`" in text and variable[len(family):] in text, \
            f"docs/api.md does not name {variable}"


def test_architecture_names_every_folder() -> None:
    """docs/architecture.md names every subpackage of p2pcoll."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    package = ROOT / "p2pcoll"
    for folder in sorted(p for p in package.iterdir() if p.is_dir() and p.name != "__pycache__"):
        assert f"`{folder.name}/`" in text, f"docs/architecture.md lacks {folder.name}/"


# -- every command marked runnable ---------------------------------------------------------


def runnable_blocks() -> list[Block]:
    return [b for path in DOCS for b in blocks(path) if b.runnable]


def test_runnable_marks_are_well_formed() -> None:
    marked = runnable_blocks()
    assert marked, "no block of README.md or docs/ is marked runnable"
    for block in marked:
        assert block.language == "bash", f"{block}: only bash blocks run ({block.info!r})"
        assert block.tier in TIERS, f"{block}: unknown tier {block.tier!r} (one of {list(TIERS)})"
        assert "pip install" not in block.body, f"{block}: a runnable block installs nothing"
    for path in DOCS:
        for block in blocks(path):
            assert "runnable" not in block.info or block.runnable, \
                f"{block}: write the mark as '```LANGUAGE runnable [TIER]', not {block.info!r}"


def scratch(tmp_path: Path) -> Path:
    """A directory like the repository's root for commands to run in, without writing there."""
    for name in SHARED:
        (tmp_path / name).symlink_to(ROOT / name, target_is_directory=True)
    return tmp_path


def command_env() -> dict[str, str]:
    """The environment of the tests, with this interpreter's `python` and `p2pcoll` first."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.mark.parametrize("block", [
    pytest.param(b, id=str(b), marks=[m for m in [TIERS[b.tier]] if m is not None]
                 + [pytest.mark.timeout(SECONDS[b.tier] + 30)])
    for b in runnable_blocks()
])
def test_runnable_block_runs(block: Block, tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", block.body], cwd=scratch(tmp_path),
        env=command_env(), check=False, capture_output=True, text=True,
        timeout=SECONDS[block.tier],
    )
    assert done.returncode == 0, (
        f"{block} ({block.body.strip()!r}) exited {done.returncode}\n"
        f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


# -- the Quickstart, the blocking example and two hosts, with what they print --------------


def quickstart_script() -> str:
    """The python block of the README's "Quickstart" (``hello.py``)."""
    scripts = fenced(section(README.read_text(), "Quickstart"), "python")
    assert scripts, "the Quickstart section has no python block"
    return scripts[0]


def quickstart_shown() -> tuple[str, list[str]]:
    """The command the Quickstart shows (``$ ...``) and the lines it shows it printing."""
    console = fenced(section(README.read_text(), "Quickstart"), "console")
    assert console, "the Quickstart shows no console block"
    lines = console[0].strip().splitlines()
    assert lines[0].startswith("$ "), lines[0]
    return lines[0][2:], lines[1:]


@pytest.mark.processes
def test_quickstart_prints_what_it_shows(tmp_path: Path) -> None:
    """The Quickstart's command and script, run as written, print the lines it shows (in
    any order: the ranks print concurrently)."""
    (tmp_path / "hello.py").write_text(quickstart_script())
    command, shown = quickstart_shown()
    assert command == "p2pcoll launch -n 2 -- python hello.py"
    done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=command_env(), check=False,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert sorted(done.stdout.splitlines()) == sorted(shown), done.stdout


@pytest.mark.processes
def test_blocking_snippet_runs(tmp_path: Path) -> None:
    """The API section's blocking example, run as written by two peers of the launcher."""
    script = tmp_path / "blocking.py"
    script.write_text(next(b for b in fenced(section(README.read_text(), "The API"), "python")
                           if "p2pcoll.blocking.join(" in b))
    done = subprocess.run(
        [sys.executable, "-m", "p2pcoll", "launch", "-n", "2", "--",
         sys.executable, str(script)],
        check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    for rank in (0, 1):
        line = rf"^\[{rank}\] {rank} \[1\. 1\. 1\. 1\.\] \[2\. 2\. 2\. 2\.\] True$"
        assert re.search(line, done.stdout, flags=re.MULTILINE), done.stdout


@pytest.mark.processes
@pytest.mark.parametrize("behind_nat", [False, True], ids=["direct", "behind-nat"])
def test_two_hosts_commands_run(tmp_path: Path, behind_nat: bool) -> None:
    """The "Two hosts" section's commands for host A and host B, run as written on this
    host (host A's address replaced by loopback, its port by a free one), with the
    section's job key made by its own keygen command; each prints the Quickstart's line.
    ``behind_nat``: host B's command is the "Behind NAT" one (reached through the relay)."""
    from p2pcoll.transport.endpoints import free_port

    commands = [b.strip() for b in fenced(section(README.read_text(), "Two hosts"), "bash")]
    keygen = next(b for b in commands if "p2pcoll keygen job.key" in b)
    lines = [line for b in commands for line in b.splitlines()]
    ranks = [next(line for line in lines if f"RANK={r} " in line
                  and ("P2PCOLL_REACHABLE=0" in line) == (behind_nat and r == 1))
             for r in (0, 1)]
    assert "scp job.key" in keygen, "host A's block copies the key to host B"
    (tmp_path / "hello.py").write_text(quickstart_script())
    done = subprocess.run([sys.executable, "-m", "p2pcoll", "keygen", "job.key"], cwd=tmp_path,
                          check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    address = re.search(r"tcp://([0-9.]+):(\d+)", ranks[0])
    assert address and address.group(0) in ranks[1], "both hosts name host A's rendezvous"
    here = f"tcp://127.0.0.1:{free_port()}"
    peers = [subprocess.Popen(["bash", "-c", line.replace(address.group(0), here)],
                              cwd=tmp_path, env=command_env(), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for line in ranks]
    try:
        outputs = [peer.communicate(timeout=120) for peer in peers]
    finally:
        for peer in peers:
            if peer.poll() is None:
                peer.kill()
                peer.wait()
    _, shown = quickstart_shown()
    for rank, (peer, (out, err)) in enumerate(zip(peers, outputs, strict=True)):
        assert peer.returncode == 0, f"rank {rank}: exit {peer.returncode}\n{out}\n{err}"
        assert out.strip() == shown[rank].split(" ", 1)[1], out  # without the launcher's [r]
