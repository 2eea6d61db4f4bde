"""ToolCallParser: a completion's text, as it streams, -> plain text or tool-call pieces.

The completion of a request with tools is constrained (`tools.ToolPlan.grammar`) to be a
plain answer or calls written as `open {"name": "f", "<args_key>": {...}} close`, one
after another (`tools.ToolFormat`). The parser decides which as soon as the text cannot
be the start of a call any more (the answer is then passed on unchanged), and streams a
call as OpenAI's chunks do: a first piece with the call's id and name once the name is
complete, then the arguments' JSON text piece by piece as it arrives. The end of the
arguments is found by counting brackets outside JSON strings, so nothing is held back
longer than the grammar's closing text.

Pure and incremental: `feed(text)` for each new piece of detokenized text, `finish()` at
the end. The grammar makes the text well formed, but a completion may end inside a call
(max_tokens, a stop string, a cancel). Nothing generated is then dropped, and what `finish`
reports matches what was streamed:
    - a call whose name was complete (its id, name and some arguments already streamed) is
      reported in `calls` with the arguments generated so far, which do not parse, and
      `partial` is set: OpenAI answers a call cut by max_tokens the same way, with
      finish_reason "length";
    - text of a call that had not reached its name yet (e.g. `<tool_call>\n{"na`), which
      was held back, is returned as plain text (vLLM returns the text of a call it could
      not parse as content).
"""

from __future__ import annotations

import json
import re
import uuid

from protocol.structured import FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta
from service.engine.constraints.tools import ToolFormat

__all__ = ["ToolCallParser", "new_call_id"]


def new_call_id() -> str:
    """OpenAI's form of a tool call id: "call_" and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallParser:
    """Splits one completion into text and tool calls.

    Args:
        fmt: how calls are written (open / close text, the arguments' key).
    """

    def __init__(self, fmt: ToolFormat, *, between: str = r"\s*") -> None:
        self.fmt = fmt
        # `between`: what may come before a call (the envelope's list: a comma)
        self._head = re.compile(between + re.escape(fmt.open.strip()) + r"\s*\{\s*\"name\"\s*:\s*"
                                r"\"((?:[^\"\\]|\\.)*)\"\s*,\s*\"" + re.escape(fmt.args_key)
                                + r"\"\s*:\s*")
        self._mode = "undecided"  # -> "text" | "calls"
        self._buf = ""
        self.calls: list[ToolCall] = []  # complete calls
        self._args: list[str] = []  # the current call's arguments so far
        self._id = ""
        self._name = ""
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._started = False  # the current call's arguments have begun
        self._closing = False  # a call ended: its closing text is still to skip
        self._brace_seen = False
        self.partial = False  # `finish` reported a call cut before its end

    @property
    def is_calls(self) -> bool:
        """The completion is calls (not a plain answer)."""
        return self._mode == "calls"

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """(plain text to pass on, call pieces) for the next piece of the completion."""
        if self._mode == "text":
            return text, []
        self._buf += text
        if self._mode == "undecided":
            lead = self._buf.lstrip()
            opener = self.fmt.open.strip() or "{"
            if not lead or opener.startswith(lead):
                return "", []  # may still become a call
            if not lead.startswith(opener):
                self._mode = "text"
                out, self._buf = self._buf, ""
                return out, []
            self._mode = "calls"
        return "", self._parse()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """(text held back, last pieces) at the end of the completion."""
        if self._mode == "undecided":  # only blanks or a prefix of the opener: text
            out, self._buf = self._buf, ""
            self._mode = "text"
            return out, []
        if self._mode == "text":
            return "", []
        pieces = self._parse()
        if self._started:  # cut inside the arguments: report what was streamed
            self.calls.append(ToolCall(id=self._id, function=FunctionCall(
                self._name, "".join(self._args))))
            self._started = False
            self.partial = True
            return "", pieces
        if self._closing:  # the arguments are complete; the closing text was cut
            return "", pieces
        out, self._buf = self._buf, ""  # a call cut before its name was complete
        return out, pieces

    def _parse(self) -> list[ToolCallDelta]:
        pieces: list[ToolCallDelta] = []
        while True:
            if self._closing and not self._skip_close():
                return pieces
            if not self._started:
                m = self._head.match(self._buf)
                if m is None:
                    return pieces
                self._name = json.loads(f'"{m.group(1)}"')
                self._id = new_call_id()
                self._buf = self._buf[m.end():]
                self._started = True
                self._args = []
                self._depth, self._in_string, self._escape = 0, False, False
                pieces.append(ToolCallDelta(index=len(self.calls), id=self._id, type="function",
                                            function=FunctionCallDelta(name=self._name)))
            if not self._args:  # blanks before the arguments' opening bracket
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return pieces
            end = self._scan(self._buf)
            chunk = self._buf if end is None else self._buf[:end]
            if chunk:
                self._args.append(chunk)
                pieces.append(ToolCallDelta(index=len(self.calls),
                                            function=FunctionCallDelta(arguments=chunk)))
            if end is None:
                self._buf = ""
                return pieces
            # the arguments are complete: the call's closing brace and text come next
            self.calls.append(ToolCall(id=self._id, function=FunctionCall(
                self._name, "".join(self._args))))
            self._started = False
            self._closing = True
            self._buf = self._buf[end:]

    def _skip_close(self) -> bool:
        """Drop the last call's closing `}` and close text from the buffer; False while
        they have not all arrived."""
        rest = self._buf.lstrip()
        if not self._brace_seen:
            if not rest:
                return False
            if rest[0] == "}":
                rest = rest[1:]
            self._brace_seen = True
        rest = rest.lstrip()
        tail = self.fmt.close.strip()
        if tail:
            if len(rest) < len(tail) and tail.startswith(rest):
                self._buf = rest
                return False
            if rest.startswith(tail):
                rest = rest[len(tail):]
        self._buf = rest
        self._closing = self._brace_seen = False
        return True

    def _scan(self, text: str) -> int | None:
        """Where the current arguments value ends in `text` (index after it), or None;
        advances the bracket count over `text` when it does not end there."""
        for i, c in enumerate(text):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None
