"""Who may take part in a job: the job key (CurveZMQ) and the ZAP gate that checks it.

A secured job has one CurveZMQ keypair, the *job key*, in a file only the job's peers can
read (``p2pcoll keygen PATH``). Every socket of the job (the rendezvous server and its
clients, every mesh link) runs CURVE with it: the server side of each connection holds the
job's secret key, the client side proves it holds the same, and the ZAP handler of the
process (:mod:`.zap`) refuses any client key other than the job's. So only holders of the
key can join, get a message accepted, or read traffic.
"""

from .keys import JobKey, write_key_file
from .zap import Gate

__all__ = ["Gate", "JobKey", "write_key_file"]
