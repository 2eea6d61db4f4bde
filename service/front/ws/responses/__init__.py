"""The OpenAI Responses API's WebSocket mode at `ws://HOST:PORT/v1/responses`, and the
parts `POST /v1/responses` (service/front/openai/responses.py) shares with it.

    connection.py  the actor of one socket: response.create in, events out, one response
                   in flight per lane (stream_id), cancel on close
    admit.py       a checked create -> its prompt (tools rendered) -> the engine's queue;
                   the context a finished response leaves
    run.py         one response in flight: engine events -> Responses streaming events
    items.py       its output items as they stream: the message and function calls
    context.py     a turn's prompt token ids: the previous response's context + the new items
    store.py       the bounded per-connection store of completed responses' contexts

Frames are protocol/responses.py (events), protocol/responses_request.py (create) and
protocol/responses_tools.py (function tools and call items).
"""

from service.front.ws.responses.connection import ResponsesConnection

__all__ = ["ResponsesConnection"]
