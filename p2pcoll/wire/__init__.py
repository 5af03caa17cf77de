"""The wire format: msgpack headers (:mod:`.header`) and their one validation point
(:mod:`.validation`)."""

from .header import (
    ABSENT,
    BLAMES,
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
    Header,
    Signature,
    encode_header,
)
from .validation import REASONS, Limits, decode_header, validate

__all__ = [
    "ABSENT", "BLAMES", "DIGEST_BYTES", "FAILED", "FINISHED", "KINDS", "MAX_TAG", "NOT_STARTED",
    "OWN", "REASONS", "SILENT", "STATES", "WAITING", "WIRE_VERSION", "Header", "Limits",
    "Signature", "decode_header", "encode_header", "validate",
]
