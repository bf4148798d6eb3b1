"""How a worker that joins an elastic job receives the current state: over HTTP, from a survivor.

torchft's own HTTPTransport listens on every interface and loads what it receives with
`torch.load(weights_only=False)`, which unpickles whatever a peer sends. This one listens where it
is told (loopback unless the job names hosts) and loads with `weights_only=True`: a state is
tensors, numbers, strings and the containers of them, never code.

The protocol is torchft's `CheckpointTransport`: a survivor that the lighthouse names as the
source `send_checkpoint`s its state for one step (kept by reference: the survivor does not touch
it until its `should_commit`, which calls `disallow_checkpoint` and so waits for a fetch in
flight); the joiner `recv_checkpoint`s it from the survivor's `metadata()` address.
"""

from __future__ import annotations

import io
import threading
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from torchft.checkpointing.transport import CheckpointTransport


class StateTransport(CheckpointTransport[dict]):
    """Serve this worker's state for the step being healed; fetch a survivor's."""

    def __init__(self, host: str = "127.0.0.1", timeout: timedelta = timedelta(seconds=60)):
        self._host = host
        self._timeout = timeout
        self._step: int | None = None
        self._state: Any = None
        # Held by each request while it reads the state; the worker takes it back (blocking on a
        # fetch in flight) before it changes the state again.
        self._readers = threading.Condition()
        self._reading = 0
        self._allowed = False
        transport = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                transport._serve(self)

            def log_message(self, *args: Any) -> None:
                pass  # a fetch is not news; failures reach the joiner as its own error

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="labavg-state-transport")
        self._thread.start()

    def metadata(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/state/"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict,
                        timeout: timedelta) -> None:
        with self._readers:
            self._state, self._step, self._allowed = state_dict, step, True
            self._readers.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._readers:
            self._allowed = False
            self._readers.wait_for(lambda: self._reading == 0)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                        timeout: timedelta) -> dict:
        with urllib.request.urlopen(f"{metadata}{step}", timeout=timeout.total_seconds()) as f:
            data = f.read()
        return torch.load(io.BytesIO(data), weights_only=True)

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join()

    def _serve(self, request: BaseHTTPRequestHandler) -> None:
        try:
            step = int(request.path.rstrip("/").rsplit("/", 1)[-1])
        except ValueError:
            request.send_error(404)
            return
        with self._readers:
            ready = self._readers.wait_for(lambda: self._allowed and self._step == step,
                                           self._timeout.total_seconds())
            if not ready:
                request.send_error(409, f"not serving step {step}")
                return
            self._reading += 1
        try:
            buf = io.BytesIO()
            torch.save(self._state, buf)
        finally:
            with self._readers:
                self._reading -= 1
                self._readers.notify_all()
        request.send_response(200)
        request.send_header("Content-Type", "application/octet-stream")
        request.send_header("Content-Length", str(buf.tell()))
        request.end_headers()
        request.wfile.write(buf.getvalue())
