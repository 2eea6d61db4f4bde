"""The network front: one ASGI app (Starlette) holding every route, typed against
`service.engine.client.EngineClient`, so the same app serves one process (uvicorn,
`service.front.server.FrontServer`) and the Ray ingress (a RemoteEngine behind it).
From `service.engine` it imports only the contract, the stream type and the prompt types.

    app.py          the routes: /health, /metrics, / (chat page), the WebSocket routes
                    /v1/stream and /v1/responses, and the OpenAI HTTP API
    access.py       who may use a route: the Origin guard and API keys (403 / 401)
    server.py       FrontServer: uvicorn on host:port, graceful drain
    starting.py     what the port answers while the model loads
    serve.py        `conveyor serve` in one process: bind, load, serve, drain on a signal
    static/         the built-in chat page
    openai/         POST /v1/chat/completions, /v1/completions, GET /v1/models
    ws/             the WebSocket routes: one transport, the socket actor, the outbox,
                    /v1/stream and responses/ (/v1/responses)
"""
