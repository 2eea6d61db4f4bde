"""The OpenAI Responses API's WebSocket mode at `ws://HOST:PORT/v1/responses`.

    connection.py  the actor of one socket: response.create in, events out, one response
                   in flight per lane (stream_id), cancel on close
    run.py         one response in flight: engine events -> Responses streaming events
    context.py     a turn's prompt token ids: the previous response's context + the new items
    store.py       the bounded per-connection store of completed responses' contexts

Frames are protocol/responses.py (events) and protocol/responses_request.py (create).
"""

from service.front.ws.responses.connection import ResponsesConnection

__all__ = ["ResponsesConnection"]
