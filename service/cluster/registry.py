"""The request routers living in this process, by the deployment they route to.

The ingress reads them for /health (replicas that can take requests) and /metrics
(routing decisions, and the replicas to ask for their engine metrics). This lives apart
from service.cluster.router because Ray Serve ships a custom router's module to the
handle's process pickled by value: globals of that module are copies there, while this
module is imported by reference, so both sides see one registry.
"""

from __future__ import annotations

import weakref
from typing import Any

_routers: weakref.WeakSet[Any] = weakref.WeakSet()


def register(router: Any) -> None:
    """Called by a router when Ray Serve initializes it."""
    _routers.add(router)


def routers_for(deployment: str) -> list[Any]:
    """Routers of this process whose `deployment_name` is `deployment`."""
    return [r for r in list(_routers) if r.deployment_name == deployment]
