"""The network front: one ASGI app (Starlette) holding every route, typed against
`service.engine.client.EngineClient`, so the same app serves one process (uvicorn,
`service.front.server.FrontServer`) and the Ray ingress (a RemoteEngine behind it).

    app.py          the routes: /health, /metrics, / (chat page), the WebSocket routes
                    /v1/stream and /v1/responses, and the OpenAI HTTP API
    guard.py        Origin and API-key checks before any route (403 / 401)
    sockets.py      WebSocket routes: access, connection limit (1013), the socket actor
    asgi_socket.py  an ASGI WebSocket with the surface the socket actors use
    ws_protocol.py  uvicorn's websockets-based WebSocket protocol with our limits
    server.py       FrontServer: uvicorn on host:port, graceful drain
    openai/         POST /v1/chat/completions, /v1/completions, GET /v1/models
"""
