"""``python -m p2pcoll``: the same program as the ``p2pcoll`` command."""

from p2pcoll.cli import main

raise SystemExit(main())
