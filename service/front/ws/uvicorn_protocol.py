"""uvicorn's WebSocket protocols (both on the websockets library) with Conveyor's socket
settings.

uvicorn sets the frame size limit and the keepalive pings from its Config; what it does
not expose is set here, per accepted socket, from ServerConfig:

- `write_limit_bytes`: the transport's write-buffer high-water mark. Above it a send
  waits, so a slow reader's backlog collects (and merges) in its Outbox, where
  `max_outbox_bytes` counts it;
- `socket_send_buffer_bytes`: SO_SNDBUF (None: the kernel's autotuning);
- `close_timeout`: seconds the closing handshake may take before the TCP connection is
  dropped (a peer that stopped reading cannot hold a socket open);
- websockets' log lines go to the `websockets.server` logger with API keys redacted;
- the transport's abort goes in the scope's extensions (`TRANSPORT_ABORT`), so that
  `AsgiSocket.transport.abort()` really drops a peer that does not finish the closing
  handshake within `close_timeout` (a send waiting for a stalled reader blocks the close).

`impl`: "websockets-sansio" (default: websockets' sans-I/O core driven by uvicorn, the
implementation uvicorn keeps) or "websockets" (websockets' legacy asyncio protocol,
deprecated by uvicorn).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import warnings
from typing import Any

from service.config import ServerConfig
from service.front.access import RedactingLogger
from service.front.ws.socket import TRANSPORT_ABORT

WS_IMPLS = ("websockets-sansio", "websockets")


def _set_sndbuf(transport: asyncio.BaseTransport, size: int | None) -> None:
    sock = transport.get_extra_info("socket")
    if size is not None and sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)


def ws_protocol(config: ServerConfig, impl: str = "websockets-sansio") -> type[Any]:
    """A uvicorn WebSocket protocol class applying `config`'s socket settings (uvicorn's
    `ws=`). Raises ValueError for an unknown `impl`."""
    if impl == "websockets-sansio":
        from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

        class SansIO(WebSocketsSansIOProtocol):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                self.close_timeout = config.close_timeout
                # websockets' own lines (the handshake's request line carries ?api_key=)
                # go to its usual logger, with the key redacted
                self.conn.logger = RedactingLogger(logging.getLogger("websockets.server"))
                self.conn.debug = self.conn.logger.isEnabledFor(logging.DEBUG)

            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                _set_sndbuf(transport, config.socket_send_buffer_bytes)
                transport.set_write_buffer_limits(high=config.write_limit_bytes)  # type: ignore
                super().connection_made(transport)

            def handle_connect(self, event: Any) -> None:
                super().handle_connect(event)
                scope = getattr(self, "scope", None)  # None: the handshake was refused
                if scope is not None:
                    scope["extensions"][TRANSPORT_ABORT] = self.transport.abort

        return SansIO
    if impl == "websockets":
        with warnings.catch_warnings():  # uvicorn's implementation is on websockets.legacy
            warnings.simplefilter("ignore", DeprecationWarning)
            from uvicorn.protocols.websockets.websockets_impl import WebSocketProtocol

        class Legacy(WebSocketProtocol):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                self.write_limit = config.write_limit_bytes  # applied in connection_made
                self.close_timeout = config.close_timeout

            def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore
                _set_sndbuf(transport, config.socket_send_buffer_bytes)
                super().connection_made(transport)  # type: ignore[arg-type]

        return Legacy
    raise ValueError(f"ws impl must be one of {', '.join(WS_IMPLS)}, got {impl!r}")
