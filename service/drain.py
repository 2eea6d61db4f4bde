"""What a front (the in-process Engine, the cluster's RemoteEngine) shares for a graceful
shutdown: stop accepting, then wait until no request is in flight."""

from __future__ import annotations

import asyncio


class Drainable:
    """Mixin: `begin_shutdown()` and `wait_idle()` over the class's `accepting` flag and
    `num_unfinished` count (requests admitted or being admitted, not yet done)."""

    accepting: bool

    @property
    def num_unfinished(self) -> int:
        raise NotImplementedError

    def begin_shutdown(self) -> None:
        """Stop accepting requests (new ones get ShuttingDown); the ones in flight go on."""
        self.accepting = False

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is in flight; False if `timeout` seconds passed first."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self.num_unfinished:
            if deadline is not None and loop.time() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True
