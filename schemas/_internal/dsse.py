"""The DSSE envelope (https://github.com/secure-systems-lab/dsse/blob/master/envelope.md).

The model only checks shapes; signature checks are the verifier's job, over the payload bytes
exactly as received. Reading a payload without them is ``layout.statement_unverified``.
"""

from __future__ import annotations

from pydantic import Field

from .statement import Contract

#: The payload type of an in-toto statement.
IN_TOTO_PAYLOAD_TYPE = "application/vnd.in-toto+json"


class Signature(Contract):
    """One signature: base64 of the signature bytes and an optional key hint."""

    sig: str = Field(description="base64 (standard or URL-safe) of the signature bytes")
    keyid: str = Field(default="", description="hint only: the sha256 of the raw public key, in hex")


class Envelope(Contract):
    """A DSSE envelope: base64 payload, its type, and one or more signatures over PAE."""

    payload: str = Field(description="base64 (standard or URL-safe) of the payload bytes")
    payload_type: str = Field(alias="payloadType")
    signatures: list[Signature] = Field(min_length=1)
