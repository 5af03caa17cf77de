"""The job key: one CurveZMQ keypair shared by the peers of a job, kept in a 0600 file.

The file is in ZeroMQ's certificate format (what ``zmq.auth.load_certificate`` reads)::

    # p2pcoll job key: keep it secret (mode 0600); anyone who reads it can join the job
    metadata
    curve
        public-key = "..."
        secret-key = "..."

Why one shared keypair rather than a key per peer with a list of authorised keys: a peer
of a job is interchangeable with any other (ranks are assigned at the rendezvous, a
restarted peer must be let back in), so a per-peer list would have to be distributed to
every peer, and kept in step, before any peer could start; one file handed to every peer
the way torchrun hands out MASTER_ADDR is what launchers, compose and Kubernetes Secrets
can do. The cost: a leaked file lets its holder in until the job gets a new key, and peers
cannot be told apart by key (they are by rank, inside the encrypted links).
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq

from ..errors import SettingsError

HEADER = ("# p2pcoll job key: keep it secret (mode 0600); anyone who can read it can join "
          "the job\n")


@dataclass(frozen=True, repr=False)
class JobKey:
    """A job's CurveZMQ keypair (Z85-encoded, 40 bytes each) and where it came from.

    ``repr`` never shows the secret key.
    """

    public: bytes
    secret: bytes
    source: str = ""

    def __repr__(self) -> str:
        return f"JobKey(public={self.public.decode()!r}, source={self.source!r})"

    @property
    def domain(self) -> str:
        """The ZAP domain of this job's sockets: different jobs in one process, with
        different keys, are checked against their own key."""
        return "p2pcoll-" + hashlib.blake2b(self.public, digest_size=8).hexdigest()

    @classmethod
    def generate(cls) -> JobKey:
        public, secret = zmq.curve_keypair()
        return cls(public, secret, "generated")

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, where: str = "key_file=") -> JobKey:
        """Read a job key file.

        Raises:
            SettingsError: the file is missing or unreadable, holds no secret key, its
                keys do not belong together, or others than its owner may read it.
        """
        shown = os.fspath(path)

        def bad(problem: str) -> SettingsError:
            return SettingsError(f"{where}{shown!r}: {problem}", name=where, value=shown,
                                 allowed="a job key file made by `p2pcoll keygen PATH`")

        from zmq.auth import load_certificate  # (pyzmq's certificates: a job key's only)

        try:
            mode = os.stat(path).st_mode
            public, secret = load_certificate(path)
        except (OSError, ValueError) as exc:
            raise bad(f"cannot read the job key ({exc})") from None
        if mode & stat.S_IRWXO:  # group access is allowed: a Kubernetes Secret with fsGroup
            raise bad(f"mode {stat.S_IMODE(mode):04o} lets every user of the host read the "
                      f"job key; chmod 600 it")
        if not secret:
            raise bad("it holds no secret-key (a public certificate is not a job key)")
        try:
            derived = zmq.curve_public(secret)
        except (zmq.ZMQError, ValueError) as exc:
            raise bad(f"the secret key is malformed ({exc})") from None
        if derived != public:
            raise bad("its public-key does not belong to its secret-key")
        return cls(public, secret, shown)


def write_key_file(path: str | os.PathLike[str], key: JobKey | None = None) -> JobKey:
    """Write a new job key (or ``key``) to ``path`` with mode 0600 and return it.

    Raises:
        FileExistsError: ``path`` exists (a job key is never overwritten).
        OSError: the file cannot be created.
    """
    key = key or JobKey.generate()
    text = (f"{HEADER}metadata\ncurve\n    public-key = \"{key.public.decode()}\"\n"
            f"    secret-key = \"{key.secret.decode()}\"\n")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return JobKey(key.public, key.secret, os.fspath(Path(path)))
