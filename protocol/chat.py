"""Terminal chat with a Conveyor server: `python -m protocol.chat [--url URL] ...`.

Each line you type is sent, with the whole conversation so far, as the
`messages` of a `generate`; the answer prints as it streams, followed by a dim
one-line summary (finish reason, tokens, TTFT, decode tokens/s, prefix-cache
hits). Ctrl-C while an answer streams cancels it and returns to the prompt
(a second Ctrl-C stops waiting for the server's `done`); Ctrl-C or Ctrl-D at
the prompt quits.

Lines are read by a daemon thread (a blocked `readline` must not keep the
process alive at exit) and handed to the event loop through a queue.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
from typing import Any, TextIO

import msgspec
from websockets.exceptions import WebSocketException

from protocol.client import Client, Stream, connect
from protocol.errors import ClientConnectionClosed, ProtocolError
from protocol.messages import ChatMessage, Delta, Done, SamplingParams

DEFAULT_URL = "ws://127.0.0.1:8765/v1/stream"
PROMPT = "> "


class Chat:
    """A multi-turn conversation on one connection, printed to `out`.

    Args:
        client: an open Client.
        out: where prompts, answers and summaries go.
        system: optional system message opening the conversation.
        params: SamplingParams fields for every answer (e.g. temperature=0.7).
        color: wrap summaries in ANSI dim (and errors in red).
    """

    def __init__(
        self,
        client: Client,
        out: TextIO,
        *,
        system: str | None = None,
        params: dict[str, Any] | None = None,
        color: bool = False,
    ) -> None:
        self.client = client
        self.out = out
        self.params = dict(params or {})
        self.color = color
        self.history: list[ChatMessage] = [ChatMessage("system", system)] if system else []
        self.lines: asyncio.Queue[str | None] = asyncio.Queue()
        self._stream: Stream | None = None
        self._answer: asyncio.Task[None] | None = None
        self._cancel_sent = False
        self._background: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        """Prompt, answer, repeat, until `lines` yields None (EOF or Ctrl-C at the prompt).

        Raises ClientConnectionClosed when the connection is lost.
        """
        while True:
            self.out.write(PROMPT)
            self.out.flush()
            line = await self.lines.get()
            if line is None:
                self.out.write("\n")
                return
            if line.strip():
                await self.ask(line)

    async def ask(self, text: str) -> None:
        """Send `text` as the next user turn and print the streamed answer and its summary.

        The answer (also a partial one, when cancelled) joins the history; a
        request the server rejected leaves the history as it was.
        """
        self.history.append(ChatMessage("user", text))
        self._stream = self.client.generate(messages=self.history, **self.params)
        self._cancel_sent = False
        self._answer = asyncio.create_task(self._print_answer(self._stream))
        try:
            await self._answer
        finally:
            self._answer = self._stream = None

    def interrupt(self) -> None:
        """Ctrl-C: cancel the streaming answer (twice: stop waiting for it), or quit at the prompt."""
        if self._answer is None or self._stream is None:
            self.lines.put_nowait(None)
        elif not self._cancel_sent:
            self._cancel_sent = True
            task = asyncio.create_task(self._send_cancel(self._stream.id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        else:
            self._answer.cancel()

    async def _print_answer(self, stream: Stream) -> None:
        parts: list[str] = []
        done: Done | None = None
        try:
            async for event in stream:
                if isinstance(event, Delta):
                    parts.append(event.text)
                    self.out.write(event.text)
                    self.out.flush()
                else:
                    done = event
        except ProtocolError as exc:
            self.history.pop()
            self.note(f"error: {exc.code}: {exc.message}", error=True)
            return
        except asyncio.CancelledError:
            if not self._cancel_sent:  # not our second Ctrl-C: let it through
                raise
        self.out.write("\n")
        self.history.append(ChatMessage("assistant", "".join(parts)))
        if stream.error is not None:
            self.note(f"error: {stream.error.code}: {stream.error.message}", error=True)
        self.note(summary(done) if done is not None else "[stopped waiting for the server]")

    async def _send_cancel(self, request_id: str) -> None:
        try:
            await self.client.cancel(request_id)
        except ClientConnectionClosed:
            pass  # the stream itself reports the closed connection

    def note(self, text: str, *, error: bool = False) -> None:
        """Print one line of chat chrome: dim, or red for an error, when `color` is on."""
        if self.color:
            text = f"\x1b[{'31' if error else '2'}m{text}\x1b[0m"
        self.out.write(text + "\n")
        self.out.flush()


def summary(done: Done) -> str:
    """One line about a finished answer, from the server's usage and timings.

    E.g. "[stop · 8 tokens · ttft 48 ms · 43.1 tok/s · cached 0/37 prompt tokens]".
    tok/s is the decode rate, 1000 / tpot_ms; parts whose timing is None are left out.
    """
    usage, timings = done.usage, done.timings
    parts = [done.finish_reason, f"{usage.completion_tokens} tokens"]
    if timings.ttft_ms is not None:
        parts.append(f"ttft {timings.ttft_ms:.0f} ms")
    if timings.tpot_ms:
        parts.append(f"{1000.0 / timings.tpot_ms:.1f} tok/s")
    parts.append(f"cached {usage.cached_tokens}/{usage.prompt_tokens} prompt tokens")
    return "[" + " · ".join(parts) + "]"


def _read_stdin(loop: asyncio.AbstractEventLoop, lines: asyncio.Queue[str | None]) -> None:
    """Thread body: put each stdin line (without its newline) on `lines`, then None at EOF."""
    while True:
        raw = sys.stdin.readline()
        line = raw.removesuffix("\n") if raw else None
        try:
            loop.call_soon_threadsafe(lines.put_nowait, line)
        except RuntimeError:  # the loop is closed: we are exiting
            return
        if line is None:
            return


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="chat", description="Chat with a Conveyor server.")
    parser.add_argument("--url", default=DEFAULT_URL, help=f"WebSocket URL (default {DEFAULT_URL})")
    parser.add_argument("--system", help="system message opening the conversation")
    parser.add_argument("--temperature", type=float,
                        help="sampling temperature (0 = greedy); default: the server's, from "
                             "the model's generation config")
    parser.add_argument("--max-tokens", type=int, help="most tokens per answer")
    parser.add_argument("--api-key", default=os.environ.get("CONVEYOR_API_KEY") or None,
                        help="sent as 'Authorization: Bearer KEY' (default: "
                             "$CONVEYOR_API_KEY, as the server reads it)")
    return parser.parse_args(argv)


async def _chat(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {}
    if args.temperature is not None:
        params["temperature"] = args.temperature
    if args.max_tokens is not None:
        params["max_tokens"] = args.max_tokens
    try:
        msgspec.convert(params, SamplingParams)
    except msgspec.ValidationError as exc:
        print(f"bad sampling parameters: {exc}", file=sys.stderr)
        return 2
    try:
        client = await connect(args.url, api_key=args.api_key)
    except (OSError, TimeoutError, ProtocolError, WebSocketException) as exc:
        print(f"cannot connect to {args.url}: {exc}", file=sys.stderr)
        return 1
    loop = asyncio.get_running_loop()
    async with client:
        chat = Chat(client, sys.stdout, system=args.system, params=params, color=sys.stdout.isatty())
        hello = client.hello
        chat.note(f"{hello.model} (context {hello.max_model_len} tokens) at {args.url}")
        if hello.sampling_defaults and "temperature" not in params:
            d = hello.sampling_defaults
            chat.note("the model's defaults: " + ", ".join(f"{k} {v:g}" for k, v in d.items()))
        chat.note("Ctrl-C stops an answer; Ctrl-D or Ctrl-C at the prompt quits.")
        threading.Thread(target=_read_stdin, args=(loop, chat.lines), daemon=True).start()
        loop.add_signal_handler(signal.SIGINT, chat.interrupt)
        try:
            await chat.run()
        except ClientConnectionClosed as exc:
            print(f"\nconnection lost: {exc}", file=sys.stderr)
            return 1
        finally:
            loop.remove_signal_handler(signal.SIGINT)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m protocol.chat`; returns the exit status."""
    return asyncio.run(_chat(_parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
