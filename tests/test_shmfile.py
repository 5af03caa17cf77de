"""The one shared-memory file module (p2pcoll.transport.shmfile): create, map a name a peer
sent (hostile names included), unlink, close, sweep; on the real /dev/shm."""

from __future__ import annotations

import mmap
import os
import stat
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from p2pcoll.errors import ProtocolError
from p2pcoll.transport import shmfile
from p2pcoll.transport.shmfile import NAME, PAGE, SHM_DIR, ShmFile

def ours() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"p2pcoll-{os.getpid()}-")}


@pytest.fixture
def clean():
    before = ours()
    yield
    assert ours() == before, "a test left files in /dev/shm"


def fake_name(pid: int | None = None) -> str:
    return f"p2pcoll-{pid or os.getpid()}-{os.urandom(8).hex()}"


def test_create_makes_a_reserved_private_file_named_after_this_process(clean) -> None:
    f = ShmFile.create(3 * PAGE)
    try:
        match = NAME.fullmatch(f.name)
        assert match is not None and int(match.group(1)) == os.getpid()
        info = os.stat(f.path)
        assert stat.S_IMODE(info.st_mode) == 0o600
        assert info.st_size == f.size == 3 * PAGE
        assert info.st_blocks * 512 >= 3 * PAGE  # reserved, not sparse
        assert f.owner and f.linked and len(f.map) == 3 * PAGE
    finally:
        f.close()
    assert not os.path.exists(f.path)  # the creator unlinks it when it closes


def test_a_peer_maps_the_same_bytes_and_unlinks_the_name(clean) -> None:
    mine = ShmFile.create(2 * PAGE)
    peer = ShmFile.open(mine.name, "lane", min_size=2 * PAGE, max_size=2 * PAGE)
    try:
        assert not peer.owner and peer.size == 2 * PAGE
        np.frombuffer(mine.map, np.int64)[7] = 1234
        assert np.frombuffer(peer.map, np.int64)[7] == 1234
        peer.unlink()
        peer.unlink()  # idempotent
        assert not os.path.exists(mine.path)
        np.frombuffer(peer.map, np.int64)[8] = 99  # the mappings outlive the name
        assert np.frombuffer(mine.map, np.int64)[8] == 99
    finally:
        peer.close()
        mine.close()  # its name is gone already: no error
        mine.close()


def test_close_with_a_live_view_leaves_the_unmapping_to_the_gc(clean) -> None:
    f = ShmFile.create(PAGE)
    view = np.frombuffer(f.map, np.uint8)
    f.close()  # BufferError inside: not raised
    assert f.closed and not os.path.exists(f.path)
    view[0] = 1  # still mapped while the view lives
    del view


def test_a_peer_closing_does_not_unlink(clean) -> None:
    mine = ShmFile.create(2 * PAGE)
    try:
        ShmFile.open(mine.name, "board").close()
        assert os.path.exists(mine.path)
    finally:
        mine.close()


@pytest.mark.parametrize("size", [0, -1, shmfile.MAX_FILE_BYTES + 1])
def test_create_refuses_a_bad_size(size: int) -> None:
    with pytest.raises(ValueError, match="bytes"):
        ShmFile.create(size)


def test_create_leaves_nothing_when_it_fails() -> None:
    with pytest.raises(OSError):
        ShmFile.create(PAGE, directory=os.path.join(SHM_DIR, "p2pcoll-test-missing"))
    # /dev/shm cannot reserve a terabyte: refused at once, nothing left behind.
    directory = tempfile.mkdtemp(prefix="p2pcoll-test-", dir=SHM_DIR)
    try:
        with pytest.raises(OSError):
            ShmFile.create(shmfile.MAX_FILE_BYTES, directory=directory)
        assert os.listdir(directory) == []
    finally:
        os.rmdir(directory)


HOSTILE = [
    None, 7, b"p2pcoll-1-0123456789abcdef", ["p2pcoll-1-0123456789abcdef"], "",
    "../../etc/passwd", "/etc/passwd", "p2pcoll-1-0123456789abcdef/../../etc/passwd",
    "../p2pcoll-1-0123456789abcdef", "p2pcoll-1-0123456789abcdef\n",
    "p2pcoll-1-0123456789abcdef\x00", " p2pcoll-1-0123456789abcdef",
    "p2pcoll-01-0123456789abcdef", "p2pcoll-0-0123456789abcdef",
    "p2pcoll-12345678901-0123456789abcdef", "p2pcoll-1-0123456789ABCDEF",
    "p2pcoll-1-0123456789abcde", "p2pcoll-1-0123456789abcdef0",
    "p2pcoll-\u0661-0123456789abcdef",  # an Arabic-Indic digit one
    "P2PCOLL-1-0123456789abcdef", "p2pcoll-1-0123456789abcdeg",
    "p2pcoll-1-" + "0" * 10**6,  # huge: refused by its length, without a scan
]


@pytest.mark.parametrize("name", HOSTILE, ids=lambda n: repr(n)[:40])
def test_names_that_are_not_ours_are_refused(name: object) -> None:
    with pytest.raises(ProtocolError, match=r"^lane name .* is not one of ours$"):
        ShmFile.open(name, "lane")


def test_a_well_formed_name_of_no_file(clean) -> None:
    with pytest.raises(ProtocolError, match="cannot map ring"):
        ShmFile.open(fake_name(), "ring")


def test_a_symbolic_link_is_not_followed(clean) -> None:
    target = ShmFile.create(2 * PAGE)
    link = os.path.join(SHM_DIR, fake_name())
    os.symlink(target.path, link)
    try:
        with pytest.raises(ProtocolError, match="cannot map lane"):
            ShmFile.open(os.path.basename(link), "lane")
    finally:
        os.unlink(link)
        target.close()


def test_a_second_link_to_a_file_is_refused(clean) -> None:
    target = ShmFile.create(2 * PAGE)
    other = os.path.join(SHM_DIR, fake_name())
    os.link(target.path, other)
    try:
        with pytest.raises(ProtocolError, match="not a lane file of this user"):
            ShmFile.open(os.path.basename(other), "lane")
    finally:
        os.unlink(other)
        target.close()


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_what_is_not_a_regular_file_is_refused_without_blocking(clean, kind: str) -> None:
    name = fake_name()
    path = os.path.join(SHM_DIR, name)
    if kind == "directory":
        os.mkdir(path, 0o700)
    else:
        os.mkfifo(path, 0o600)
    try:
        with pytest.raises(ProtocolError, match=f"board {name!r}"):
            ShmFile.open(name, "board")
    finally:
        (os.rmdir if kind == "directory" else os.unlink)(path)


def test_a_file_of_another_user_is_refused(clean, monkeypatch) -> None:
    target = ShmFile.create(2 * PAGE)
    try:
        uid = os.geteuid()
        monkeypatch.setattr(shmfile.os, "geteuid", lambda: uid + 1)
        with pytest.raises(ProtocolError, match="not a ring file of this user"):
            ShmFile.open(target.name, "ring")
    finally:
        monkeypatch.undo()
        target.close()


@pytest.mark.parametrize(("size", "bounds"), [
    (PAGE, (PAGE + 1, 1 << 20)),  # too small (a header page and nothing more)
    (4 * PAGE, (PAGE + 1, 2 * PAGE)),  # too large
])
def test_sizes_outside_the_bounds_are_refused(clean, size: int, bounds: tuple[int, int]
                                              ) -> None:
    target = ShmFile.create(size)
    try:
        with pytest.raises(ProtocolError, match=f"has {size} bytes, not {bounds[0]} to"):
            ShmFile.open(target.name, "lane", min_size=bounds[0], max_size=bounds[1])
    finally:
        target.close()


def test_an_empty_file_is_refused_before_mapping(clean) -> None:
    name = fake_name()
    path = os.path.join(SHM_DIR, name)
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    try:
        with pytest.raises(ProtocolError, match="has 0 bytes"):
            ShmFile.open(name, "ring", min_size=0 + 1)
    finally:
        os.unlink(path)


def test_sweep_removes_the_files_of_exited_creators_only(tmp_path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)
    gone = tmp_path / fake_name(child.pid)
    alive = tmp_path / fake_name()
    other = tmp_path / f"other-{child.pid}"
    for path in (gone, alive, other):
        path.write_bytes(b"x")
    assert shmfile.sweep(str(tmp_path)) == 1
    assert sorted(os.listdir(tmp_path)) == sorted([alive.name, other.name])


def test_a_mapping_is_a_plain_mmap() -> None:
    f = ShmFile.create(PAGE)
    try:
        assert isinstance(f.map, mmap.mmap)
    finally:
        f.close()
