"""Runs torch's own backend conformance tests against a torch.distributed backend.

torch ships the tests it holds every backend to (``DistributedTest._DistTestBase`` in
``torch.testing._internal.distributed.distributed_test``, run per backend with ``BACKEND``,
``WORLD_SIZE`` and ``TEMP_DIR``). A third-party backend takes part by being added to
``DistTestCases.backend_feature["plugin"]`` (and ``["ddp"]`` for the DDP tests), which is
what this script does for any backend other than Gloo. "p2pcoll" is found as users find it:
the ``torch.backends`` entry point of the installed package registers it inside
``import torch``.

    python tests/torch_suite.py --backend p2pcoll -k all_reduce -k broadcast
    python tests/torch_suite.py --backend gloo -k all_reduce      # the same tests on Gloo

Each test spawns WORLD_SIZE processes that import this file again (as ``__mp_main__``),
so the setup below runs at import, from the environment the parent set. The last line
printed is ``torch suite on BACKEND: N passed, N failed, N skipped, N errors``.
Needs ``expecttest`` (in the dev extra), which torch's test utilities import.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import unittest

# torch's test helpers read these at import: set them before importing anything of torch's.
if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="p2pcoll", help="torch backend (default p2pcoll)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("-k", dest="patterns", action="append", default=[],
                        help="run only tests whose name contains this (repeatable: any of them)")
    parser.add_argument("-v", "--verbose", action="store_true")
    ARGS = parser.parse_args()
    os.environ["BACKEND"] = ARGS.backend
    os.environ["WORLD_SIZE"] = str(ARGS.world_size)
    os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="torch-suite-")

from torch.testing._internal.common_distributed import DistTestCases

BACKEND = os.environ["BACKEND"]
if BACKEND != "gloo":
    DistTestCases.backend_feature["plugin"].add(BACKEND)
    DistTestCases.backend_feature["ddp"].add(BACKEND)

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """torch's own test class for a backend, as its test_distributed_spawn.py builds it."""

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()


def main() -> int:
    loader = unittest.TestLoader()
    if ARGS.patterns:
        loader.testNamePatterns = [f"*{p}*" for p in ARGS.patterns]
    suite = loader.loadTestsFromTestCase(TestDistBackendWithSpawn)
    started = time.monotonic()
    result = unittest.TextTestRunner(verbosity=2 if ARGS.verbose else 1,
                                     stream=sys.stdout).run(suite)
    ran, failed, errors = result.testsRun, len(result.failures), len(result.errors)
    skipped = len(result.skipped)
    passed = ran - failed - errors - skipped - len(result.unexpectedSuccesses)
    for test, _ in result.failures + result.errors:
        print(f"NOT OK {test.id()}")
    for test, why in result.skipped:
        print(f"SKIP {test.id()}: {why}")
    print(f"torch suite on {BACKEND}: {passed} passed, {failed} failed, {skipped} skipped, "
          f"{errors} errors in {time.monotonic() - started:.0f}s")
    return 0 if failed == errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
