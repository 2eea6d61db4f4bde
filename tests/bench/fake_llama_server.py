"""A small fake of llama.cpp's llama-server for the peer's unit tests: the same HTTP
shapes, no model.

- `GET /health`: 503 {"error": ...} for `--loading-s` seconds after start (llama-server
  answers so while its model loads), then 200 {"status": "ok"}.
- `POST /v1/completions` with stream=true: HTTP/1.1 chunked server-sent events as
  llama-server writes them: one `data: {...}` event per generated token ("choices"
  [{"text", "index", "logprobs", "finish_reason": null}]), then a final event with
  finish_reason "length", empty text, "usage" and "timings", then `data: [DONE]`.
  The generated tokens are " w<i>" for i = 0 .. max_tokens - 1.

Faults, chosen by the request's first prompt token id (tests pick them per request):
  1 -> HTTP 500 with a JSON error body      2 -> an {"error": ...} event mid-stream
  3 -> the connection closes before the final event
  4 -> the second token rides in the third token's chunk (a UTF-8 character split
       across tokens: llama-server sends no chunk for the first half)
  5 -> one token fewer than max_tokens, finish_reason "stop" (as with EOS)

Run as a script it is a stand-in binary: `python fake_llama_server.py -m MODEL --host H
--port P -np N -c C -t T -tb T [...]`, which also writes its argv as JSON to
$FAKE_LLAMA_ARGV_OUT when set. With $FAKE_LLAMA_DIE_AFTER=N it kills itself with SIGILL
at its (N+1)-th POST (0: at the first, the warm-up), as a build for another CPU does;
with $FAKE_LLAMA_MUTE=1 it is healthy but never answers a POST.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeLlamaServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, loading_s: float = 0.0,
                 token_delay_s: float = 0.0) -> None:
        super().__init__((host, port), _Handler)
        self.started = time.monotonic()
        self.loading_s = loading_s
        self.token_delay_s = token_delay_s
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        self.die_after: int | None = None  # POSTs served before SIGILL (None: never)
        self.mute = False                  # never answer a POST

    def handle_error(self, request, client_address) -> None:
        """A client that hung up (a test's timeout, a killed reader) is not an error of the
        fake: quiet, where socketserver would print its traceback into the test output."""
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return
        super().handle_error(request, client_address)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def start_background(self) -> FakeLlamaServer:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeLlamaServer

    def log_message(self, *args) -> None:  # quiet
        pass

    def _json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path != "/health":
            return self._json(404, {"error": {"code": 404, "message": "File Not Found"}})
        if time.monotonic() - self.server.started < self.server.loading_s:
            return self._json(503, {"error": {"code": 503, "message": "Loading model"}})
        self._json(200, {"status": "ok"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.bodies.append(body)
            if self.server.die_after is not None and len(self.server.bodies) > self.server.die_after:
                resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
                os.kill(os.getpid(), signal.SIGILL)  # an illegal instruction, as on a wrong CPU
                time.sleep(60)  # answer nothing while the signal is delivered
        if self.server.mute:
            time.sleep(3600)
            return
        if self.path != "/v1/completions":
            return self._json(404, {"error": {"code": 404, "message": "File Not Found"}})
        prompt, n = body["prompt"], body.get("max_tokens", 16)
        fault = prompt[0] if prompt else 0
        if fault == 1:
            return self._json(500, {"error": {"code": 500, "message": "fake failure"}})
        if not body.get("stream"):
            text = "".join(f" w{i}" for i in range(n))
            return self._json(200, {"choices": [{"text": text, "finish_reason": "length"}],
                                    "usage": {"completion_tokens": n,
                                              "prompt_tokens": len(prompt)}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        generated = n - 1 if fault == 5 else n
        for i in range(generated):
            if fault == 2 and i == 1:
                self._event({"error": {"code": 500, "message": "fake mid-stream error"}})
                return self._end()
            if fault == 3 and i == 2:
                self.wfile.flush()
                self.close_connection = True
                return
            time.sleep(self.server.token_delay_s)
            if fault == 4 and i == 1:
                continue  # no chunk: its bytes ride with the next token
            self._event({"choices": [{"text": f" w{i}", "index": 0, "logprobs": None,
                                      "finish_reason": None}],
                         "object": "text_completion", "model": "fake"})
        self._event({"choices": [{"text": "", "index": 0, "logprobs": None,
                                  "finish_reason": "stop" if fault == 5 else "length"}],
                     "object": "text_completion", "model": "fake",
                     "usage": {"completion_tokens": generated, "prompt_tokens": len(prompt),
                               "total_tokens": generated + len(prompt),
                               "prompt_tokens_details": {"cached_tokens": 0}},
                     "timings": {"prompt_ms": 1.0, "predicted_per_token_ms": 2.5,
                                 "cache_n": 0}})
        self._chunk(b"data: [DONE]\n\n")
        self._end()

    def _event(self, obj: dict) -> None:
        self._chunk(f"data: {json.dumps(obj)}\n\n".encode())

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _end(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def _main(argv: list[str]) -> None:
    if os.environ.get("FAKE_LLAMA_ARGV_OUT"):
        with open(os.environ["FAKE_LLAMA_ARGV_OUT"], "w") as f:
            json.dump(argv, f)
    port = int(argv[argv.index("--port") + 1])
    server = FakeLlamaServer(argv[argv.index("--host") + 1], port, loading_s=0.5)
    if os.environ.get("FAKE_LLAMA_DIE_AFTER"):
        server.die_after = int(os.environ["FAKE_LLAMA_DIE_AFTER"])
    server.mute = os.environ.get("FAKE_LLAMA_MUTE") == "1"
    server.serve_forever()


if __name__ == "__main__":
    _main(sys.argv[1:])
