"""The README's two set-up commands are the ones CI and newcomers run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_ci_runs_the_readme_test_command() -> None:
    blocks = bash_blocks((ROOT / "README.md").read_text())
    install_and_demo, tests = blocks[0], blocks[1]
    assert "p2pcoll launch -n 4 -- python examples/allreduce_demo.py" in install_and_demo
    assert "pytest" in tests
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert tests in ci_lines, f"{tests!r} must appear verbatim as a line of .ci/run"


def test_readme_names_every_builtin_strategy() -> None:
    import p2pcoll

    text = (ROOT / "README.md").read_text()
    for collective, names in p2pcoll.available_strategies().items():
        for name in names:
            if name == "direct":  # the example plugin, documented in its own README
                continue
            assert f"`{name}`" in text, f"README does not mention {collective} strategy {name}"
