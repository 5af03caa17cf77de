"""The wire format: msgpack headers (:mod:`.header`) and their one validation point
(:mod:`.validation`)."""

from .header import DIGEST_BYTES, KINDS, WIRE_VERSION, Header, Signature, encode_header
from .validation import Limits, decode_header, link_rank, validate

__all__ = [
    "DIGEST_BYTES", "KINDS", "WIRE_VERSION", "Header", "Limits", "Signature",
    "decode_header", "encode_header", "link_rank", "validate",
]
