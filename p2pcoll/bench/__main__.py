"""``python -m p2pcoll.bench``: the same command as ``p2pcoll bench``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .driver import main as run
from .options import configure_parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m p2pcoll.bench",
        description="Time a collective between peer processes (nccl-tests style).",
    )
    configure_parser(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
