"""Every setting, from an argument of ``join`` or the environment, is checked once, and a bad
one is a ``SettingsError`` naming the variable (or argument), the value and what is allowed.

First ``Settings.resolve`` on its own, with an explicit environment (so the test process's
own variables never leak in), then the same contract through ``p2pcoll.join``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from typing import Any

import numpy as np
import pytest

from p2pcoll.registry import check_chosen

import p2pcoll
from p2pcoll.errors import SettingsError, UnknownStrategy
from p2pcoll.registry import available_strategies
from p2pcoll.settings import Settings
from p2pcoll.testing import free_port

K, M = 1 << 10, 1 << 20
COLLECTIVES = ("broadcast", "reduce", "allreduce", "allgather", "reduce_scatter", "gather",
               "scatter", "barrier")
SWITCHES = {"1": True, "0": False, "true": True, "false": False, "yes": True, "no": False,
            "on": True, "off": False, "TRUE": True, "Off": False}
# Variable, field, minimum: each takes a byte count with K/M/G suffixes.
SIZES = [("P2PCOLL_SEGMENT_BYTES", "segment_bytes", 1 * K),
         ("P2PCOLL_MAX_MESSAGE_BYTES", "max_message_bytes", 4 * K),
         ("P2PCOLL_SHM_BYTES", "shm_bytes", 64 * K)]
SIZE_TEXTS = {"1K": 1 * K, "64K": 64 * K, "1M": 1 * M, "16M": 16 * M, "1G": 1 << 30,
              "65536": 64 * K, "64KiB": 64 * K, "64KB": 64 * K, "2m": 2 * M}


def assert_names(exc: BaseException, name: str, value: object, allowed: str) -> None:
    """The message names the variable or argument, the value given and what is allowed."""
    msg = str(exc)
    assert isinstance(exc, ValueError)
    assert name in msg, f"{name!r} not named in {msg!r}"
    assert str(value) in msg, f"value {value!r} not in {msg!r}"
    assert allowed in msg, f"{allowed!r} (what is allowed) not in {msg!r}"


# --- the environment: good values ---------------------------------------------------------

def test_defaults() -> None:
    s = Settings.resolve({})
    assert (s.rendezvous, s.world_size, s.rank, s.host) == (None, None, None, None)
    assert s.transport == "auto"
    assert (s.collective_timeout, s.join_timeout) == (300, 60)
    assert dict(s.strategies) == {}
    assert (s.segment_bytes, s.pipeline_depth, s.max_message_bytes) == (1 * M, None, 256 * M)
    assert (s.shm, s.shm_bytes, s.tune_malloc) == (True, 16 * M, True)


@pytest.mark.parametrize(("env", "field", "want"), [
    ({"P2PCOLL_RENDEZVOUS": "tcp://10.0.0.1:29500"}, "rendezvous", "tcp://10.0.0.1:29500"),
    ({"MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29501"}, "rendezvous", "tcp://10.0.0.2:29501"),
    ({"P2PCOLL_RENDEZVOUS": "tcp://a:1", "MASTER_ADDR": "b", "MASTER_PORT": "2"},
     "rendezvous", "tcp://a:1"),
    ({"P2PCOLL_HOST": "10.0.0.3"}, "host", "10.0.0.3"),
    ({"P2PCOLL_TIMEOUT": "5"}, "collective_timeout", 5.0),
    ({"P2PCOLL_TIMEOUT": "2.5"}, "collective_timeout", 2.5),
    ({"P2PCOLL_TIMEOUT": "inf"}, "collective_timeout", math.inf),
    ({"P2PCOLL_JOIN_TIMEOUT": "7"}, "join_timeout", 7.0),
    ({"P2PCOLL_PIPELINE_DEPTH": "1"}, "pipeline_depth", 1),
    ({"P2PCOLL_PIPELINE_DEPTH": "64"}, "pipeline_depth", 64),
    ({"WORLD_SIZE": "4"}, "world_size", 4),
    ({"SLURM_NTASKS": "5"}, "world_size", 5),
    ({"OMPI_COMM_WORLD_SIZE": "6"}, "world_size", 6),
    ({"RANK": "0", "WORLD_SIZE": "1"}, "rank", 0),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "3"}, "rank", 2),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}, "rank", 3),
], ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else None)
def test_environment_good(env: dict[str, str], field: str, want: object) -> None:
    assert getattr(Settings.resolve(env), field) == want


@pytest.mark.parametrize("name", ["auto", "tcp", "ipc", "inproc"])
def test_transport_names(name: str) -> None:
    assert Settings.resolve({"P2PCOLL_TRANSPORT": name}).transport == name


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_strategy_per_collective(collective: str) -> None:
    # An installed strategy of that collective (a name that is not one is a SettingsError).
    name = next(n for n in available_strategies()[collective] if n != "auto")
    s = Settings.resolve({f"P2PCOLL_{collective.upper()}": name})
    assert dict(s.strategies) == {collective: name}


@pytest.mark.parametrize("text", SIZE_TEXTS)
@pytest.mark.parametrize(("var", "field", "minimum"), SIZES, ids=[v for v, _, _ in SIZES])
def test_sizes(var: str, field: str, minimum: int, text: str) -> None:
    """Every spelling is accepted where it is at least the minimum, and named when not."""
    if SIZE_TEXTS[text] >= minimum:
        assert getattr(Settings.resolve({var: text}), field) == SIZE_TEXTS[text]
    else:
        with pytest.raises(SettingsError) as caught:
            Settings.resolve({var: text})
        assert_names(caught.value, var, text, "byte count")


@pytest.mark.parametrize("text", SWITCHES)
@pytest.mark.parametrize(("var", "field"), [("P2PCOLL_SHM", "shm"),
                                            ("P2PCOLL_TUNE_MALLOC", "tune_malloc")])
def test_switches(var: str, field: str, text: str) -> None:
    assert getattr(Settings.resolve({var: text}), field) is SWITCHES[text]


# --- the environment: bad values ----------------------------------------------------------

@pytest.mark.parametrize(("env", "var", "value", "allowed"), [
    ({"P2PCOLL_PIPELINE_DEPTH": "0"}, "P2PCOLL_PIPELINE_DEPTH", "0", "64"),
    ({"P2PCOLL_PIPELINE_DEPTH": "65"}, "P2PCOLL_PIPELINE_DEPTH", "65", "64"),
    ({"P2PCOLL_PIPELINE_DEPTH": "four"}, "P2PCOLL_PIPELINE_DEPTH", "four", "integer"),
    ({"P2PCOLL_TIMEOUT": "abc"}, "P2PCOLL_TIMEOUT", "abc", "seconds"),
    ({"P2PCOLL_TIMEOUT": "0"}, "P2PCOLL_TIMEOUT", "0", "seconds"),
    ({"P2PCOLL_TIMEOUT": "-1"}, "P2PCOLL_TIMEOUT", "-1", "seconds"),
    ({"P2PCOLL_TIMEOUT": "nan"}, "P2PCOLL_TIMEOUT", "nan", "seconds"),
    ({"P2PCOLL_JOIN_TIMEOUT": "abc"}, "P2PCOLL_JOIN_TIMEOUT", "abc", "seconds"),
    ({"P2PCOLL_JOIN_TIMEOUT": "0"}, "P2PCOLL_JOIN_TIMEOUT", "0", "seconds"),
    ({"P2PCOLL_SEGMENT_BYTES": "1x"}, "P2PCOLL_SEGMENT_BYTES", "1x", "byte count"),
    ({"P2PCOLL_SEGMENT_BYTES": "512"}, "P2PCOLL_SEGMENT_BYTES", "512", "1K"),
    ({"P2PCOLL_SEGMENT_BYTES": "-1K"}, "P2PCOLL_SEGMENT_BYTES", "-1K", "byte count"),
    ({"P2PCOLL_MAX_MESSAGE_BYTES": "10"}, "P2PCOLL_MAX_MESSAGE_BYTES", "10", "4K"),
    ({"P2PCOLL_SHM_BYTES": "1K"}, "P2PCOLL_SHM_BYTES", "1K", "64K"),
    ({"P2PCOLL_SHM": "maybe"}, "P2PCOLL_SHM", "maybe", "true"),
    ({"P2PCOLL_TUNE_MALLOC": "maybe"}, "P2PCOLL_TUNE_MALLOC", "maybe", "true"),
    ({"P2PCOLL_TRANSPORT": "udp"}, "P2PCOLL_TRANSPORT", "udp", "tcp"),
    ({"RANK": "abc"}, "RANK", "abc", "integer"),
    ({"RANK": "-1"}, "RANK", "-1", "integer"),
    ({"SLURM_PROCID": "x"}, "SLURM_PROCID", "x", "integer"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE", "0", "integer"),
    ({"OMPI_COMM_WORLD_SIZE": "many"}, "OMPI_COMM_WORLD_SIZE", "many", "integer"),
    ({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "http"}, "MASTER_PORT", "http", "port"),
    ({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "70000"}, "MASTER_PORT", "70000", "port"),
], ids=lambda v: f"{v}" if isinstance(v, str) and "=" not in v else None)
def test_environment_bad(env: dict[str, str], var: str, value: str, allowed: str) -> None:
    with pytest.raises(SettingsError) as caught:
        Settings.resolve(env)
    assert_names(caught.value, var, value, allowed)


def test_unknown_variable_is_named_in_a_warning_and_ignored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="p2pcoll"):
        s = Settings.resolve({"P2PCOLL_TIMEOUTS": "3"})
    assert s == Settings.resolve({})
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("P2PCOLL_TIMEOUTS" in r.getMessage() for r in warnings), caplog.text


# --- arguments ----------------------------------------------------------------------------

@pytest.mark.parametrize(("arguments", "name", "value", "allowed"), [
    ({"collective_timeout": 0}, "collective_timeout", 0, "seconds"),  # 0 is not "unset"
    ({"collective_timeout": -1}, "collective_timeout", -1, "seconds"),
    ({"collective_timeout": math.nan}, "collective_timeout", "nan", "seconds"),
    ({"collective_timeout": "5"}, "collective_timeout", "5", "seconds"),
    ({"join_timeout": 0}, "join_timeout", 0, "seconds"),
    ({"join_timeout": 0.0}, "join_timeout", 0.0, "seconds"),
    ({"world_size": 0}, "world_size", 0, "integer"),
    ({"rank": -1}, "rank", -1, "integer"),
    ({"transport": "udp"}, "transport", "udp", "tcp"),
    ({"strategies": {"allreduc": "ring"}}, "allreduc", "ring", "allreduce"),
    ({"strategies": {"allreduce": ""}}, "allreduce", "''", "strategy name"),
    ({"pipeline_depth": 0}, "pipeline_depth", 0, "64"),
    ({"segment_bytes": 100}, "segment_bytes", 100, "integer"),
])
def test_arguments_bad(arguments: dict[str, Any], name: str, value: object, allowed: str) -> None:
    with pytest.raises(SettingsError) as caught:
        Settings.resolve({}, **arguments)
    assert_names(caught.value, name, value, allowed)


async def test_rank_out_of_range_is_a_rendezvous_error_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each value is fine alone; together they are the RendezvousError the API pins."""
    assert Settings.resolve({"RANK": "3", "WORLD_SIZE": "2"}).rank == 3
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(p2pcoll.RendezvousError, match="rank 3 is out of range for world_size 2"):
        await asyncio.wait_for(p2pcoll.join("tcp://127.0.0.1:1"), 10)
    with pytest.raises(p2pcoll.RendezvousError, match="out of range"):
        await asyncio.wait_for(p2pcoll.join("tcp://127.0.0.1:1", rank=3, world_size=2), 10)


def test_unknown_argument_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="colective_timeout"):
        Settings.resolve({}, colective_timeout=5)


def test_infinite_deadlines_are_accepted() -> None:
    s = Settings.resolve({}, collective_timeout=math.inf, join_timeout=math.inf)
    assert (s.collective_timeout, s.join_timeout) == (math.inf, math.inf)


def test_none_means_unset() -> None:
    s = Settings.resolve({"P2PCOLL_TIMEOUT": "9", "WORLD_SIZE": "3"},
                         collective_timeout=None, world_size=None, strategies=None)
    assert (s.collective_timeout, s.world_size, dict(s.strategies)) == (9, 3, {})


# --- arguments over the environment -------------------------------------------------------

@pytest.mark.parametrize(("env", "arguments", "field", "want"), [
    ({"P2PCOLL_TIMEOUT": "9"}, {"collective_timeout": 5}, "collective_timeout", 5),
    ({"P2PCOLL_JOIN_TIMEOUT": "9"}, {"join_timeout": 5}, "join_timeout", 5),
    ({"P2PCOLL_RENDEZVOUS": "tcp://a:1"}, {"rendezvous": "tcp://b:2"}, "rendezvous",
     "tcp://b:2"),
    ({"WORLD_SIZE": "8", "RANK": "7"}, {"world_size": 4, "rank": 1}, "world_size", 4),
    ({"WORLD_SIZE": "8", "RANK": "7"}, {"world_size": 4, "rank": 1}, "rank", 1),
    ({"P2PCOLL_TRANSPORT": "tcp"}, {"transport": "ipc"}, "transport", "ipc"),
])
def test_argument_over_environment(
    env: dict[str, str], arguments: dict[str, Any], field: str, want: object
) -> None:
    assert getattr(Settings.resolve(env, **arguments), field) == want


def test_strategies_merged_argument_winning_per_key() -> None:
    env = {"P2PCOLL_ALLREDUCE": "ring", "P2PCOLL_BROADCAST": "binomial"}
    s = Settings.resolve(env, strategies={"broadcast": "root", "gather": "root"})
    assert dict(s.strategies) == {"allreduce": "ring", "broadcast": "root", "gather": "root"}
    s = Settings.resolve({"P2PCOLL_ALLREDUCE": "ring"}, strategies={"broadcast": "root"})
    assert dict(s.strategies) == {"allreduce": "ring", "broadcast": "root"}


# --- through join -------------------------------------------------------------------------

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "SLURM_NTASKS", "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE",
                 "OMPI_COMM_WORLD_RANK")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No P2PCOLL_* or launcher variable of the test process reaches join()."""
    for name in list(os.environ):
        if name.startswith("P2PCOLL_") or name in LAUNCHER_VARS:
            monkeypatch.delenv(name)
    return monkeypatch


async def join_and_close(**arguments: Any) -> None:
    """Join (the call that must fail); if it does not, close the group it formed."""
    g = await p2pcoll.join(**arguments)
    await g.close()


@pytest.mark.parametrize(("env", "arguments", "named"), [
    ({"P2PCOLL_PIPELINE_DEPTH": "0"}, {}, "P2PCOLL_PIPELINE_DEPTH"),
    ({"P2PCOLL_TIMEOUT": "abc"}, {}, "P2PCOLL_TIMEOUT"),
    ({}, {"collective_timeout": 0}, "collective_timeout"),
])
async def test_join_rejects_a_bad_setting_at_once(
    clean_env: pytest.MonkeyPatch, env: dict[str, str], arguments: dict[str, Any], named: str
) -> None:
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(SettingsError, match=named):
        await asyncio.wait_for(join_and_close(world_size=1, **arguments), 10)


@pytest.mark.parametrize("strategy", sorted(p2pcoll.available_strategies()["allreduce"]))
async def test_small_segments_and_depth_one_take_effect(
    clean_env: pytest.MonkeyPatch, strategy: str
) -> None:
    """A 1 MiB allreduce between 2 peers in 64 KiB segments, one in flight at a time."""
    clean_env.setenv("P2PCOLL_PIPELINE_DEPTH", "1")
    clean_env.setenv("P2PCOLL_SEGMENT_BYTES", "64K")
    url = f"tcp://127.0.0.1:{free_port()}"
    n = M // 8  # float64

    async def peer(rank: int) -> tuple[np.ndarray, dict[str, int]]:
        async with p2pcoll.join(url, world_size=2, rank=rank, timeout=30,
                                collective_timeout=30) as g:
            total = await g.allreduce(np.arange(n, dtype=np.float64) + rank, strategy=strategy)
            return total, g.stats()

    results = await asyncio.gather(peer(0), peer(1))
    want = 2 * np.arange(n, dtype=np.float64) + 1
    for total, stats in results:
        assert np.array_equal(total, want)
        # No message carries more than one 64 KiB segment of payload.
        assert stats["messages_sent"] >= stats["bytes_sent"] / (64 * K), stats


def test_a_strategy_variable_naming_no_installed_strategy_is_a_setting_error() -> None:
    # Settings read the name; whether it is installed is checked where the plugins load
    # (join, before any socket), in the registry's layer.
    env = {"P2PCOLL_ALLREDUCE": "rign"}
    settings = Settings.resolve(env)
    with pytest.raises(SettingsError) as caught:
        check_chosen(settings.strategies, env)
    assert str(caught.value).splitlines()[0].startswith(
        "$P2PCOLL_ALLREDUCE='rign' is not allowed: no allreduce strategy named 'rign' "
        "(did you mean 'ring'?); available: auto, ")
    assert caught.value.name == "$P2PCOLL_ALLREDUCE" and caught.value.value == "rign"
    assert isinstance(caught.value, UnknownStrategy)  # as the same name in code is
    assert Settings.resolve({"P2PCOLL_ALLREDUCE": "auto"}).strategies == {"allreduce": "auto"}


def test_what_settings_exported_before_the_reader_moved_out_still_imports() -> None:
    # p2pcoll.settings_env holds the reader and its checks; p2pcoll.settings re-exports them.
    import p2pcoll.settings as settings
    import p2pcoll.settings_env as settings_env
    for name in ("parse_bytes", "format_bytes", "check_seconds", "check_path", "MIN_LINKS"):
        assert getattr(settings, name) is getattr(settings_env, name), name
    for name in ("Settings", "RendezvousLimits", "ServiceSettings", "job_key", "KNOWN_VARS",
                 "TRANSPORT_NAMES", "LOG_LEVELS", "bad_value", "RANK_VARS", "WORLD_SIZE_VARS"):
        assert hasattr(settings, name), name


@pytest.mark.parametrize(("name", "variable", "value", "allowed"), [
    ("job_id", "P2PCOLL_JOB_ID", "-job", "up to 128 letters"),
    ("host_id", "P2PCOLL_HOST_ID", "a b", "a host name of up to 64"),
])
def test_ids_are_checked_alike_from_the_environment_and_from_arguments(
        name: str, variable: str, value: str, allowed: str) -> None:
    with pytest.raises(SettingsError) as from_env:
        Settings.resolve({variable: value, "WORLD_SIZE": "1"})
    with pytest.raises(SettingsError) as from_argument:
        Settings.resolve({"WORLD_SIZE": "1"}, **{name: value})
    assert (from_env.value.name, from_argument.value.name) == (f"${variable}", f"{name}=")
    assert from_env.value.allowed == from_argument.value.allowed
    assert from_env.value.allowed.startswith(allowed)
