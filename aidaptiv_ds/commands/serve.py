"""Serve a model over the OpenAI HTTP API, its weights streamed from NVMe when they do not fit the host budget.

  aidaptiv-ds serve --model out/model                                # http://127.0.0.1:8000/v1
  aidaptiv-ds serve --model smollm2.gguf --host-budget 1GiB --nvme-path /nvme/swap --port 8080
  AIDAPTIV_SERVE_API_KEY=... aidaptiv-ds serve --model out/model --host 0.0.0.0

/v1/models, /v1/completions and /v1/chat/completions (with "stream": true as server-sent events), for the
openai client, LangChain, Open WebUI and the editors' assistants: point them at http://HOST:PORT/v1. Requests
that arrive together are decoded together (see aidaptiv_ds.inference.serving); bad ones are answered in the API's
error shape. It listens on loopback unless a key is set (AIDAPTIV_SERVE_API_KEY or --api-key-file; clients send
it as their API key), answers on loopback only requests for localhost or a loopback address (a web page whose name
resolves to this machine gets nothing) and no other site's page (aidaptiv_ds.common.http_guard, the studio's rule
too), and sends no CORS grant to any origin.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from aidaptiv_ds.commands import flags
from aidaptiv_ds.common.http_guard import is_loopback, refusal

HELP_EPILOG = """exit codes:
  0  stopped (Ctrl-C)
  1  refused (an address without a key, a model that cannot be loaded)
  2  bad command line"""
MAX_BODY = 4 << 20  # a request larger than this is refused (413): prompts, not uploads


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        required=True,
        metavar="MODEL",
        help="a Hugging Face folder, a hub id, a .gguf file, or a checkpoint of 'aidaptiv-ds train'",
    )
    m.add_argument(
        "--served-model-name", default=None, metavar="NAME", help="its name in the API (default: the folder's)"
    )
    m.add_argument(
        "--max-tokens", type=int, default=256, metavar="N", help="new tokens when a request names none (256)"
    )
    h = p.add_argument_group("HTTP")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    h.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    h.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="a file holding the API key clients must send (needed when --host is not a loopback address; or set "
        "AIDAPTIV_SERVE_API_KEY)",
    )
    b = p.add_argument_group("batching")
    b.add_argument("--max-batch", type=int, default=8, metavar="N", help="requests decoded together (default 8)")
    b.add_argument(
        "--batch-wait-ms",
        type=float,
        default=20.0,
        metavar="MS",
        help="how long the first waiting request waits for others to join its batch (default 20)",
    )
    s = p.add_argument_group("memory and disk")
    flags.add(s, flags.HOST_BUDGET, default="auto", help="host memory for weights (as in generate; default auto)")
    flags.add(
        s, flags.NVME_PATH, default=None, help="folder on the NVMe SSD for the weights that do not fit the budget"
    )
    flags.add(s, flags.DTYPE, auto=True, default="auto", help="weights' dtype in memory (default auto: as stored)")
    s.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda when there is one")
    flags.add(s, flags.GPU_MEM_CAP_GB, default=None, help="with cuda: act as if the GPU had only this much memory")
    s.add_argument(
        "--kv-cache",
        default=None,
        metavar="DIR",
        help="keep prompts' keys and values here (requests then run one at a time)",
    )


def api_key(args) -> Optional[str]:
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as fh:
            return fh.read().strip() or None
    return os.environ.get("AIDAPTIV_SERVE_API_KEY") or None


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, handler, *, queue, served, key, max_tokens, context, log):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, handler)
        self.queue, self.served, self.key = queue, served, key
        self.bound = address[0]
        self.max_tokens, self.context, self.log = max_tokens, context, log
        self.started = int(time.time())


class Handler(BaseHTTPRequestHandler):
    server: Server
    server_version = "aidaptiv-ds"

    def log_message(self, fmt, *args):  # one line per request on stderr, without the client's address noise
        self.server.log(f"{self.command} {self.path} {args[1] if len(args) > 1 else ''}")

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, e) -> None:
        self._send(e.status, e.body())

    def _admitted(self):
        """The checks every request passes first: addressed to this server, and with the key when one is set."""
        from aidaptiv_ds.inference.openai_api import APIError

        refused = refusal(
            self.headers.get_all("Host") or [], self.headers.get_all("Origin") or [], self.server.bound,
            who="aidaptiv-ds serve",
        )  # fmt: skip
        if refused:
            return APIError(refused[0], refused[1], kind="forbidden")
        if self.server.key:
            given = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            if not hmac.compare_digest(given.encode(), self.server.key.encode()):
                return APIError(
                    401, "a valid API key is needed (Authorization: Bearer KEY)", kind="authentication_error"
                )
        return None

    def do_GET(self):
        from aidaptiv_ds.inference import openai_api
        from aidaptiv_ds.inference.openai_api import APIError

        refused = self._admitted()
        if refused:
            return self._error(refused)
        if self.path.rstrip("/") == "/v1/models":
            return self._send(200, openai_api.models(self.server.served, self.server.started))
        if self.path.rstrip("/") == "/health":
            return self._send(200, {"status": "ok", **self.server.queue.stats})
        self._error(APIError(404, f"no such route: GET {self.path}", kind="not_found_error"))

    def do_POST(self):
        from aidaptiv_ds.inference import openai_api
        from aidaptiv_ds.inference.openai_api import APIError

        refused = self._admitted()
        if refused:
            return self._error(refused)
        route = self.path.rstrip("/")
        if route not in ("/v1/completions", "/v1/chat/completions"):
            return self._error(APIError(404, f"no such route: POST {self.path}", kind="not_found_error"))
        # JSON only: a form or text/plain post (what another site's page can send without asking) is refused
        if self.headers.get("Content-Type", "").split(";")[0].strip() != "application/json":
            return self._error(APIError(415, "send the request as application/json"))
        size = int(self.headers.get("Content-Length") or 0)
        if size > MAX_BODY:
            return self._error(APIError(413, f"the request has {size} bytes, more than {MAX_BODY}"))
        try:
            body = json.loads(self.rfile.read(size) or b"null")
            ask = openai_api.parse(
                body,
                route.endswith("chat/completions"),
                self.server.served,
                self.server.max_tokens,
                self.server.context,
            )
            job = self.server.queue.submit(ask)
        except json.JSONDecodeError as e:
            return self._error(APIError(400, f"the body is not JSON ({e.msg})"))
        except APIError as e:
            return self._error(e)
        if ask.stream:
            self._stream(ask, job)
        else:
            self._whole(ask, job)

    def _finish(self, ask, result) -> str:
        stops = self.server.queue.generator.stop_ids
        return "stop" if result.token_ids and result.token_ids[-1] in stops else "length"

    def _whole(self, ask, job) -> None:
        from aidaptiv_ds.inference import openai_api

        while True:
            kind, value = job.events.get()
            if kind == "error":
                return self._error(value)
            if kind == "done":
                break
        text, stopped = openai_api.cut_at_stop(value.text, ask.stop)
        finish = "stop" if stopped else self._finish(ask, value)
        self._send(200, openai_api.whole(ask, self.server.served, text, finish, value.prompt_tokens, value.new_tokens))

    def _stream(self, ask, job) -> None:
        from aidaptiv_ds.inference import openai_api

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        sent, text, first, stopped = 0, "", True, False
        try:
            while True:
                kind, value = job.events.get()
                if kind == "error":
                    self.wfile.write(f"data: {json.dumps(value.body())}\n\n".encode())
                    break
                if kind == "piece" and not stopped:
                    text += value
                    shown, stopped = openai_api.cut_at_stop(text, ask.stop)
                    # hold back what could be the start of a stop string until it is known not to be one
                    hold = 0 if stopped else max((len(s) - 1 for s in ask.stop), default=0)
                    upto = max(sent, len(shown) - hold)
                    if upto > sent or first:
                        self.wfile.write(
                            openai_api.chunk(ask, self.server.served, shown[sent:upto], first=first).encode()
                        )
                        self.wfile.flush()
                        sent, first = upto, False
                if kind == "done":
                    shown, hit = openai_api.cut_at_stop(value.text, ask.stop)
                    if len(shown) > sent or first:
                        self.wfile.write(openai_api.chunk(ask, self.server.served, shown[sent:], first=first).encode())
                    finish = "stop" if hit or stopped else self._finish(ask, value)
                    self.wfile.write(openai_api.chunk(ask, self.server.served, None, finish).encode())
                    if ask.include_usage:
                        self.wfile.write(
                            openai_api.usage_chunk(
                                ask, self.server.served, value.prompt_tokens, value.new_tokens
                            ).encode()
                        )
                    self.wfile.write(b"data: [DONE]\n\n")
                    break
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):  # the client went away: its reply runs out with the batch
            pass


def run(args) -> int:
    from aidaptiv_ds.inference.generate import Generator
    from aidaptiv_ds.inference.serving import ServingQueue
    from aidaptiv_ds.models.locate import display_name

    def say(message: str) -> None:
        print(f"aidaptiv-ds serve: {flags.as_flags(message)}", file=sys.stderr, flush=True)

    try:
        key = api_key(args)
    except OSError as e:
        say(f"cannot read --api-key-file {args.api_key_file}: {e.strerror}")
        return 1
    if not is_loopback(args.host) and not key:
        say(
            f"refusing to listen on {args.host} without an API key: whoever reaches it can use the model. Set "
            "AIDAPTIV_SERVE_API_KEY (or --api-key-file FILE), or keep the default --host 127.0.0.1"
        )
        return 1
    if args.max_batch < 1 or args.max_tokens < 1 or args.batch_wait_ms < 0:
        say("--max-batch and --max-tokens must be at least 1, --batch-wait-ms not negative")
        return 1
    try:
        gen = Generator(
            args.model,
            host_budget=args.host_budget,
            nvme_path=args.nvme_path,
            device=args.device,
            dtype=args.dtype,
            kv_cache=args.kv_cache,
            gpu_mem_cap_gb=args.gpu_mem_cap_gb,
            progress=say,
        )
    except (OSError, ValueError) as e:
        say(str(e))
        return 1
    served = args.served_model_name or display_name(args.model)
    queue = ServingQueue(gen, max_batch=args.max_batch, wait_s=args.batch_wait_ms / 1000, log=say)
    try:
        server = Server(
            (args.host, args.port),
            Handler,
            queue=queue,
            served=served,
            key=key,
            max_tokens=args.max_tokens,
            context=gen.max_context,
            log=say,
        )
    except OSError as e:
        queue.close()
        gen.close()
        say(f"cannot listen on {args.host}:{args.port}: {e.strerror}")
        return 1
    host = f"[{args.host}]" if ":" in args.host else args.host
    say(f"serving {served} at http://{host}:{server.server_address[1]}/v1 (batches of up to {args.max_batch})")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        queue.close()
        gen.close()
    return 0
