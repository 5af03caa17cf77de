"""The README's two set-up commands are the ones CI and newcomers run, and its API snippet
runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section of a markdown text (up to the next ``## ``)."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
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


def test_api_snippet_runs(tmp_path: Path) -> None:
    """The first python block of "The API", run as written by two peers of the launcher."""
    blocks = re.findall(r"```python\n(.*?)```", section((ROOT / "README.md").read_text(),
                                                        "The API"), flags=re.S)
    assert blocks, "the API section has no python block"
    script = tmp_path / "api_snippet.py"
    script.write_text(blocks[0])
    done = subprocess.run(
        [sys.executable, "-m", "p2pcoll", "launch", "-n", "2", "--",
         sys.executable, str(script)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    # Each rank printed its rank, the world size and its stats.
    for rank in (0, 1):
        assert re.search(rf"^\[{rank}\] {rank} 2 \{{", done.stdout, flags=re.M), done.stdout


def test_readme_names_every_builtin_strategy() -> None:
    import p2pcoll

    text = (ROOT / "README.md").read_text()
    for collective, names in p2pcoll.available_strategies().items():
        for name in names:
            if name == "direct":  # the example plugin, documented in its own README
                continue
            assert f"`{name}`" in text, f"README does not mention {collective} strategy {name}"


def test_how_it_is_built_names_every_module() -> None:
    """The README's tree is the package's: every subpackage and module is in it."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## How it is built", 1)[1].split("```", 2)[1]
    package = ROOT / "p2pcoll"
    for path in sorted(package.rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        rel = path.relative_to(package)
        assert path.name in block or path.stem in block, f"README's tree lacks {rel}"
    for folder in sorted(p for p in package.iterdir() if p.is_dir() and p.name != "__pycache__"):
        assert f"{folder.name}/" in block, f"README's tree lacks {folder.name}/"
