"""A response's output items as they stream: the assistant message and function calls.

`OutputItems` turns the engine's text and tool-call pieces (`Delta.text`,
`Delta.tool_calls`) into the Responses events of each item, in output order (see
protocol/responses.py). One item streams at a time: text opens the message item (once),
the first piece of a call (it has the call's id and name) opens a function_call item,
and opening an item closes the one before it. `close_all` closes the last one at the
end; every closed item is kept in `items` for the final Response object.

    message:        output_item.added, content_part.added, output_text.delta...,
                    output_text.done, content_part.done, output_item.done
    function_call:  output_item.added, function_call_arguments.delta...,
                    function_call_arguments.done, output_item.done
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence

from msgspec import Struct

from protocol.responses import (ContentPartAdded, ContentPartDone, FunctionCallArgumentsDelta,
                                FunctionCallArgumentsDone, FunctionCallItem, OutputItem,
                                OutputItemAdded, OutputItemDone, OutputMessage, OutputText,
                                OutputTextDelta, OutputTextDone)
from protocol.structured import ToolCallDelta

__all__ = ["OutputItems"]


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class OutputItems:
    """The output items of one response.

    Args:
        emit: sends one event (the run numbers it).
        message_id: the message item's id ("msg_...").
    """

    def __init__(self, emit: Callable[[Struct], None], message_id: str) -> None:
        self._emit = emit
        self.message_id = message_id
        self.items: list[OutputItem] = []  # closed items, in output order
        self.text: list[str] = []  # the message's text pieces
        self.calls: list[FunctionCallItem] = []  # every call item, as last known
        self._open: str | None = None  # "message" | "call" | None
        self._message_index: int | None = None
        self._args: list[str] = []  # the open call's arguments so far
        self._opened = 0  # items opened so far (the next one's output_index)

    # ---- opening --------------------------------------------------------------------------
    def open_message(self) -> None:
        """Open the message item (a no-op once it is open or was)."""
        if self._message_index is not None:
            return
        self._close_open(final=False)
        self._message_index = self._opened
        self._opened += 1
        self._open = "message"
        self._emit(OutputItemAdded(sequence_number=0, output_index=self._message_index,
                                   item=self._message("in_progress", None)))
        self._emit(ContentPartAdded(sequence_number=0, item_id=self.message_id,
                                    output_index=self._message_index, content_index=0,
                                    part=OutputText(text="", annotations=[], logprobs=[])))

    def add_text(self, text: str) -> None:
        if not text:
            return
        self.open_message()
        self.text.append(text)
        assert self._message_index is not None
        self._emit(OutputTextDelta(sequence_number=0, item_id=self.message_id,
                                   output_index=self._message_index, content_index=0,
                                   delta=text, logprobs=[]))

    def add_call_pieces(self, pieces: Sequence[ToolCallDelta]) -> None:
        for piece in pieces:
            if piece.id is not None:  # a new call: its id and name come first
                self._close_open(final=False)
                item = FunctionCallItem(id="fc_" + uuid.uuid4().hex, call_id=piece.id,
                                        name=piece.function.name or "", arguments="",
                                        status="in_progress")
                self.calls.append(item)
                self._args = []
                self._open = "call"
                self._opened += 1
                self._emit(OutputItemAdded(sequence_number=0, output_index=self._opened - 1,
                                           item=item))
            if piece.function.arguments and self._open == "call":
                self._args.append(piece.function.arguments)
                self._emit(FunctionCallArgumentsDelta(
                    sequence_number=0, item_id=self.calls[-1].id,
                    output_index=self._opened - 1, delta=piece.function.arguments))

    # ---- closing --------------------------------------------------------------------------
    def close_all(self, complete: bool) -> None:
        """Close the open item. complete: the output ended where the model ended it (a
        call then has whole arguments); False: cut (max_output_tokens), the message and a
        call whose arguments do not parse are "incomplete"."""
        self._close_open(final=True, complete=complete)

    def _close_open(self, *, final: bool, complete: bool = True) -> None:
        if self._open == "message":
            self._close_message("completed" if complete or not final else "incomplete")
        elif self._open == "call":
            args = "".join(self._args)
            cut = final and not complete and not _parses(args)
            self._close_call(args, "incomplete" if cut else "completed")
        self._open = None

    def _message(self, status: str, text: str | None) -> OutputMessage:
        content = [] if text is None else [OutputText(text=text, annotations=[], logprobs=[])]
        return OutputMessage(id=self.message_id, status=status,  # type: ignore[arg-type]
                             content=content)

    def _close_message(self, status: str) -> None:
        text = "".join(self.text)
        part = OutputText(text=text, annotations=[], logprobs=[])
        index = self._message_index
        assert index is not None
        ids = dict(item_id=self.message_id, output_index=index, content_index=0)
        self._emit(OutputTextDone(sequence_number=0, text=text, logprobs=[], **ids))
        self._emit(ContentPartDone(sequence_number=0, part=part, **ids))
        item = self._message(status, text)
        self._emit(OutputItemDone(sequence_number=0, output_index=index, item=item))
        self.items.append(item)

    def _close_call(self, args: str, status: str) -> None:
        opened = self.calls[-1]
        item = FunctionCallItem(id=opened.id, call_id=opened.call_id, name=opened.name,
                                arguments=args, status=status)  # type: ignore[arg-type]
        self.calls[-1] = item
        index = self._opened - 1
        self._emit(FunctionCallArgumentsDone(sequence_number=0, item_id=item.id,
                                             output_index=index, arguments=args))
        self._emit(OutputItemDone(sequence_number=0, output_index=index, item=item))
        self.items.append(item)
