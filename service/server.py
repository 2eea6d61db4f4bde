"""`conveyor serve`'s network front, one port for everything (see service/front/):
`ConveyorServer` is `service.front.server.FrontServer` (the front app on uvicorn)."""

from service.front.app import RESPONSES_PATH, STREAM_PATH
from service.front.server import FrontServer as ConveyorServer

__all__ = ["RESPONSES_PATH", "STREAM_PATH", "ConveyorServer"]
