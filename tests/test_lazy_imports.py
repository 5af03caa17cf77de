"""What ``import p2pcoll`` loads (issue 34, "nothing slower": many peers start on one host).

A plain import, down to ``p2pcoll.join``, loads no optional feature: not the relay, the
rendezvous server and its rules (only the peer that hosts needs them), the timeline, the
ring ordering of a measured topology, the board's collectives (a group on one host maps the
board once formed), shrink, robust reductions, codecs, the torch store, the in-memory
network or pyzmq's authenticator (a job key's); and no heavy third-party package. Every
public name still resolves, where it always has. A regression guard, not a timing: one
fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 120  # the longest the child may take before the test counts it as hung

# Imported where they are used, never by a plain import (see the module docstring).
DEFERRED = (
    "p2pcoll.relay.attach", "p2pcoll.relay.pipe", "p2pcoll.relay.protocol",
    "p2pcoll.relay.server", "p2pcoll.relay.thread", "p2pcoll.transport.relayed",
    "p2pcoll.rendezvous.server", "p2pcoll.rendezvous.jobs", "p2pcoll.rendezvous.admission",
    "p2pcoll.rendezvous.registrations",
    "p2pcoll.rendezvous.reach", "p2pcoll.rendezvous.probe", "p2pcoll.rendezvous.torch_store",
    "p2pcoll.api.topology", "p2pcoll.engine.ordered_ring", "p2pcoll.engine.ring_order",
    "p2pcoll.api.alltoall", "p2pcoll.engine.alltoall_table", "p2pcoll.engine.board_alltoall",
    "p2pcoll.transport.cross_memory", "p2pcoll.session.shrink", "p2pcoll.api.robust",
    "p2pcoll.engine.robust", "p2pcoll.codecs", "p2pcoll.transport.memory",
    "p2pcoll.engine.timeline", "p2pcoll.engine.board_path", "p2pcoll.training",
    "p2pcoll.blocking", "p2pcoll.testing", "zmq.auth",
)
HEAVY = ("torch", "ray", "hypothesis", "aiohttp", "matplotlib", "prometheus_client", "tqdm",
         "mpi4py", "pandas", "scipy")

# Public names of the packages whose __init__ imports them on first use: {package: names}.
LAZY_PACKAGES = {
    "p2pcoll.relay": ["Attachment", "Entrance", "Relay", "RelayLimits"],
    "p2pcoll.rendezvous": ["RendezvousServer", "advertised_host", "parse_url", "rendezvous"],
    "p2pcoll.transport": ["Counters", "Faults", "MemoryNetwork", "MemoryTransport",
                          "SocketFactory", "Transport", "ZmqMesh", "endpoint_policy",
                          "host_identity"],
}

CHILD = """
import importlib, json, sys
import p2pcoll
p2pcoll.join
plain = sorted(sys.modules)
for name in p2pcoll.__all__:
    exec(f"from p2pcoll import {name}")
resolved, missing = {}, []
for package, names in json.loads(sys.argv[1]).items():
    module = importlib.import_module(package)
    missing += [f"{package}.{name}" for name in names if name not in dir(module)]
    resolved.update({f"{package}.{name}": getattr(module, name).__module__ for name in names})
try:
    importlib.import_module("p2pcoll.relay").NoSuchName
    unknown = "no error"
except AttributeError as exc:
    unknown = str(exc)
print(json.dumps({"plain": plain, "after": sorted(sys.modules), "resolved": resolved,
                  "missing": missing, "unknown": unknown}))
"""


def _child() -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(LAZY_PACKAGES)], check=False, cwd=ROOT,
        capture_output=True, text=True, timeout=WAIT_S,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return result


def test_a_plain_import_loads_no_optional_feature_and_every_name_still_resolves() -> None:
    child = _child()
    plain = set(child["plain"])
    loaded = sorted(m for m in plain if m in DEFERRED or m.startswith(
        tuple(f"{d}." for d in DEFERRED)))
    assert not loaded, f"a plain `import p2pcoll; p2pcoll.join` imported {loaded}"
    heavy = sorted(m for m in plain if m.split(".")[0] in HEAVY)
    assert not heavy, f"a plain import pulled in {heavy}"
    assert "p2pcoll.relay.names" in plain  # what every peer needs of the relay: light
    # Every public name resolves: p2pcoll's (__all__) and the lazy packages' own.
    after = set(child["after"])
    assert not child["missing"], f"not listed by dir(): {child['missing']}"
    resolved = child["resolved"]
    assert resolved["p2pcoll.relay.Relay"] == "p2pcoll.relay.server"
    assert resolved["p2pcoll.relay.Entrance"] == "p2pcoll.relay.attach"
    assert resolved["p2pcoll.rendezvous.RendezvousServer"] == "p2pcoll.rendezvous.server"
    assert resolved["p2pcoll.transport.ZmqMesh"] == "p2pcoll.transport.zmq_mesh"
    assert resolved["p2pcoll.transport.MemoryNetwork"] == "p2pcoll.transport.memory"
    assert {"p2pcoll.relay.server", "p2pcoll.rendezvous.server"} <= after
    assert "has no attribute 'NoSuchName'" in str(child["unknown"])
