"""mrv2/core_framing.py: one code per message type, both directions, bodies round-trip."""

from __future__ import annotations

import msgspec
import pytest

from mrv2.core_framing import (ABORT, ADD, CORE_MESSAGES, OUTPUTS, SHUTDOWN, UTILITY,
                               CoreFraming)
from mrv2.protocol import EngineCoreOutput, EngineCoreOutputs, UtilityCall


def test_codes_are_distinct_single_bytes():
    assert len(set(CORE_MESSAGES)) == len(CORE_MESSAGES)
    assert all(len(code) == 1 for code in CORE_MESSAGES)


def test_messages_round_trip_and_shutdown_has_no_body():
    framing = CoreFraming()
    for code, message in ((ABORT, ["a", "b"]), (UTILITY, UtilityCall(3, "get_stats", [1])),
                          (OUTPUTS, EngineCoreOutputs([EngineCoreOutput("r", [5])], 1.5))):
        sent_code, body = framing.encode(code, message)
        assert sent_code == code and framing.decode(code, body) == message
    assert framing.encode(SHUTDOWN) == (SHUTDOWN, b"")
    assert framing.decode(SHUTDOWN, b"") is None


def test_a_body_read_as_another_message_fails():
    framing = CoreFraming()
    _, body = framing.encode(ABORT, ["a"])
    with pytest.raises(msgspec.ValidationError):
        framing.decode(ADD, body)
    with pytest.raises(KeyError):
        framing.decode(b"\x7f", body)
