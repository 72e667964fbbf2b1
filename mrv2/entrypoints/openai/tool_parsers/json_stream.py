"""A JSON object read piece by piece, re-serialised as it arrives the way
``json.dumps(json.loads(text), ensure_ascii=False)`` writes it.

Streaming a tool call's arguments needs the final arguments string (json.dumps of the parsed
value) before the value is complete. `JsonCanonicalizer.parts`, joined, is at every moment a
prefix of that string, and once the object is closed (`done`) it is the whole string: a token
goes out in its final form as soon as it is decided (structure at once, strings character by
character, a number or literal once the character after it arrives). The one difference from
``json.dumps(json.loads(...))`` is a key repeated in one object, which json.loads collapses to
its last value; callers compare with that result when the object closes.
"""

from __future__ import annotations

import json
import re

_WS = " \t\n\r"
_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')  # string characters json.dumps writes as they are
_BARE = re.compile(r"[0-9A-Za-z+\-.]+")  # numbers and literals (true, null, NaN, -Infinity, ...)
_BARE_START = "-0123456789tfnNI"
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n",
                   "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")


def _encoded(ch: str) -> str:
    return json.dumps(ch, ensure_ascii=False)[1:-1]


class JsonCanonicalizer:
    """One JSON object (the root must be an object), fed with `feed`.

    `parts`: the canonical text so far, in pieces that never change once appended.
    `spans`: for each key of the root object, ``[first part, end part]`` of its value's
    canonical text (end None while the value is still open); a repeated key keeps the last.
    `done`: the root object is closed; `error`: the text is not JSON (nothing more is read).
    """

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.spans: dict[str, list[int | None]] = {}
        self.done = False
        self.error = False
        self._stack: list[str] = []  # open containers, "{" or "["
        # what may come next: root | value | value_or_end | key | key_or_end | colon | comma_or_end
        self._expect = "root"
        self._in_string = False
        self._key_start: int | None = None  # first part of a root-level key being read
        self._escape: str | None = None  # characters after a backslash, while incomplete
        self._high: int | None = None  # a \\u high surrogate waiting for its low half
        self._bare: str | None = None  # a number or literal being read
        self._key: str | None = None  # the root-level key whose value comes next

    def feed(self, text: str) -> int:
        """Reads `text`; returns how many characters it used: all of them, or fewer when the
        root object closed (the rest is not part of it) or the text stopped being JSON."""
        i, n = 0, len(text)
        while i < n and not self.done and not self.error:
            if self._in_string:
                i = self._string(text, i)
            elif self._bare is not None:
                m = _BARE.match(text, i)
                if m:
                    self._bare += m.group()
                    i = m.end()
                if i < n:
                    self._end_bare()
            elif text[i] in _WS:
                i += 1
            else:
                self._structure(text[i])
                if self._bare is None:  # a bare token's first character is read as part of it
                    i += 1
        return i

    # ----------------------------------------------------------------- structure

    def _structure(self, c: str) -> None:
        expect = self._expect
        if c == "{" and expect in ("root", "value", "value_or_end"):
            self._open(c, "key_or_end")
        elif c == "[" and expect in ("value", "value_or_end"):
            self._open(c, "value_or_end")
        elif c == "}" and self._stack and self._stack[-1] == "{" \
                and expect in ("key_or_end", "comma_or_end"):
            self._close(c)
        elif c == "]" and self._stack and self._stack[-1] == "[" \
                and expect in ("value_or_end", "comma_or_end"):
            self._close(c)
        elif c == "," and expect == "comma_or_end":
            self.parts.append(", ")
            self._expect = "key" if self._stack[-1] == "{" else "value"
        elif c == ":" and expect == "colon":
            self.parts.append(": ")
            self._expect = "value"
        elif c == '"' and expect in ("key", "key_or_end"):
            self.parts.append('"')
            self._in_string = True
            self._key_start = len(self.parts) if len(self._stack) == 1 else None
        elif c == '"' and expect in ("value", "value_or_end"):
            self._value_start()
            self.parts.append('"')
            self._in_string = True
        elif c in _BARE_START and expect in ("value", "value_or_end"):
            self._value_start()
            self._bare = ""
        else:
            self.error = True

    def _open(self, c: str, expect: str) -> None:
        if self._expect != "root":
            self._value_start()
        self._stack.append(c)
        self.parts.append(c)
        self._expect = expect

    def _close(self, c: str) -> None:
        self._stack.pop()
        self.parts.append(c)
        self._value_done()

    def _value_start(self) -> None:
        if len(self._stack) == 1 and self._key is not None:
            self.spans[self._key] = [len(self.parts), None]

    def _value_done(self) -> None:
        if not self._stack:
            self.done = True
            return
        if len(self._stack) == 1 and self._key is not None:
            self.spans[self._key][1] = len(self.parts)
            self._key = None
        self._expect = "comma_or_end"

    def _end_bare(self) -> None:
        token, self._bare = self._bare, None
        try:
            value = json.loads(token)
        except ValueError:
            self.error = True
            return
        self.parts.append(json.dumps(value))
        self._value_done()

    # ----------------------------------------------------------------- strings

    def _string(self, text: str, i: int) -> int:
        n = len(text)
        while i < n and not self.error:
            if self._escape is not None:
                self._escape += text[i]
                i += 1
                self._escape_char()
                continue
            c = text[i]
            if c == '"':
                self._flush_high()
                self._end_string()
                return i + 1
            if c == "\\":
                self._escape = ""
                i += 1
            elif c < " ":
                self.error = True  # json.loads refuses raw control characters in strings
            else:
                m = _PLAIN.match(text, i)
                self._flush_high()
                self.parts.append(m.group())
                i = m.end()
        return i

    def _escape_char(self) -> None:
        esc = self._escape
        if esc[0] != "u":
            self._escape = None
            if esc in _SIMPLE_ESCAPES:
                self._flush_high()
                self.parts.append(_encoded(_SIMPLE_ESCAPES[esc]))
            else:
                self.error = True
            return
        if esc[-1] not in _HEX and len(esc) > 1:
            self.error = True
        elif len(esc) == 5:
            self._escape = None
            self._code_unit(int(esc[1:], 16))

    def _code_unit(self, code: int) -> None:
        if 0xDC00 <= code <= 0xDFFF and self._high is not None:
            pair = 0x10000 + ((self._high - 0xD800) << 10) + (code - 0xDC00)
            self._high = None
            self.parts.append(_encoded(chr(pair)))
            return
        self._flush_high()
        if 0xD800 <= code <= 0xDBFF:
            self._high = code  # json.loads joins it with a \\u low half that follows at once
        else:
            self.parts.append(_encoded(chr(code)))

    def _flush_high(self) -> None:
        if self._high is not None:
            self.parts.append(_encoded(chr(self._high)))
            self._high = None

    def _end_string(self) -> None:
        self._in_string = False
        if self._key_start is not None:  # a root-level key
            self._key = json.loads('"' + "".join(self.parts[self._key_start:]) + '"')
            self._key_start = None
        self.parts.append('"')
        if self._expect in ("key", "key_or_end"):
            self._expect = "colon"
        else:
            self._value_done()
