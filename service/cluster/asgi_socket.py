"""Moved to `service.front.asgi_socket` (one front serves one process and the cluster)."""

from service.front.asgi_socket import CLOSE_MESSAGE_TOO_BIG, AsgiSocket

__all__ = ["CLOSE_MESSAGE_TOO_BIG", "AsgiSocket"]
