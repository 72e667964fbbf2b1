"""The one framing of core <-> client messages (mrv2/engine/client.py <-> mrv2/core/core_proc.py):
two ZMQ frames, a one-byte message code and the msgpack body of a protocol.py message."""

from __future__ import annotations

from typing import Any

import msgspec

from mrv2.protocol import (CoreDead, EngineCoreOutputs, EngineCoreRequest, RequestRejected,
                           UtilityCall, UtilityResult)

# Every code names one message type in both directions (no byte is used twice),
# so a frame read on the wrong socket fails to decode instead of passing for another message.
ADD, ABORT, UTILITY, SHUTDOWN = b"\x00", b"\x01", b"\x02", b"\x03"  # client -> core
OUTPUTS, UTILITY_RESULT, REJECTED, DEAD = b"\x10", b"\x11", b"\x12", b"\x13"  # core -> client

CORE_MESSAGES: dict[bytes, Any] = {
    ADD: EngineCoreRequest, ABORT: list[str], UTILITY: UtilityCall, SHUTDOWN: None,
    OUTPUTS: EngineCoreOutputs, UTILITY_RESULT: UtilityResult, REJECTED: RequestRejected,
    DEAD: CoreDead}


class CoreFraming:
    """Encodes and decodes core <-> client messages as `(code, body)` frames. A body-less
    message (SHUTDOWN) has an empty body and decodes to None."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoders = {code: msgspec.msgpack.Decoder(body)
                          for code, body in CORE_MESSAGES.items() if body is not None}

    def encode(self, code: bytes, message: Any = None) -> tuple[bytes, bytes]:
        return code, b"" if message is None else self._encoder.encode(message)

    def decode(self, code: bytes, body: Any) -> Any:
        """The message of one received `(code, body)` pair; KeyError for an unknown code."""
        return None if CORE_MESSAGES[code] is None else self._decoders[code].decode(body)
