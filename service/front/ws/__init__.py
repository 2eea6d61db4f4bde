"""The WebSocket routes: one transport, one actor life cycle, two protocols.

    routes.py            the door: access, the connection limit (1013), then the actor
    socket.py            `Socket` (what the actors are typed against) and `AsgiSocket`, the
                         one transport adapter (an ASGI WebSocket: uvicorn or Ray Serve)
    uvicorn_protocol.py  uvicorn's WebSocket protocol with Conveyor's socket settings
    actor.py             SocketActor: what every route's actor shares (outbox writer,
                         close codes, cancel on close, graceful shutdown)
    outbox.py            a socket's bounded outbox (a slow reader's deltas merge)
    stream.py            Connection: the /v1/stream actor (PROTOCOL.md)
    responses/           ResponsesConnection: the /v1/responses actor (OpenAI Responses API)
"""
