"""placeholder"""
from __future__ import annotations


class OpenAIRoutes:
    def __init__(self, engine, config, access) -> None:
        self.engine = engine

    def routes(self) -> list:
        return []

    def abort_all(self) -> None:
        pass
