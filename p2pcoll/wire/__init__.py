"""The wire format: headers (:mod:`.header`: a fixed binary frame for data messages,
msgpack maps for the rest) and their one validation point (:mod:`.validation`)."""

from .header import (
    ABSENT,
    BLAMES,
    CALLS,
    DIGEST_BYTES,
    FAILED,
    FINISHED,
    KINDS,
    MAX_TAG,
    NOT_STARTED,
    OWN,
    SILENT,
    STATES,
    WAITING,
    WIRE_VERSION,
    DataHeaders,
    Header,
    Signature,
    encode_header,
    group_digest,
)
from .validation import REASONS, Limits, decode_header, validate

__all__ = [
    "ABSENT", "BLAMES", "CALLS", "DIGEST_BYTES", "FAILED", "FINISHED", "KINDS", "MAX_TAG",
    "NOT_STARTED", "OWN", "REASONS", "SILENT", "STATES", "WAITING", "WIRE_VERSION",
    "DataHeaders", "Header", "Limits", "Signature", "decode_header", "encode_header",
    "group_digest", "validate",
]
