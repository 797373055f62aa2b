"""How the page is served: Gradio's app mounted in a FastAPI app of ours (gradio.mount_gradio_app), run by
uvicorn behind HostOriginGuard, which answers every request Gradio must not see.

Not Blocks.launch(): the app launch() builds (gradio 6.31) checks no Host header, and its CORS layer
(route_utils.CustomCORSMiddleware) echoes any Origin whenever the Host is not a localhost name. A web page whose
name resolves to 127.0.0.1 (DNS rebinding) could then start training and read the root through a studio that
listens on loopback without a password. launch() also calls itself at http://{host}:{port}/, which is no URL
for an IPv6 address (`--host ::1` failed with httpx.InvalidURL).

What is accepted is aidaptiv_ds.common.http_guard's rule, the one every HTTP endpoint of the product keeps
(`serve` too): on loopback only localhost and loopback names, on any port (an SSH tunnel's); bound to another
address (which needs a password), any name, the password being the check; and no other origin's page.
"""

from __future__ import annotations

import asyncio
import errno
import socket

from aidaptiv_ds.common.http_guard import is_loopback, refusal


def url_for(host: str, port: int) -> str:
    host = host.strip("[]")
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


class HostOriginGuard:
    """ASGI layer in front of the whole app: refuses a request for a Host the studio is not bound to (421) or
    from another origin's page (403), with a one-line body, before anything behind it runs."""

    def __init__(self, app, bound_host: str):
        self.app = app
        self.any_host = not is_loopback(bound_host)

    def refusal(self, scope) -> tuple[int, str] | None:
        hosts, origins = [], []
        for key, value in scope.get("headers") or ():
            if key == b"host":
                hosts.append(value.decode("latin-1"))
            elif key == b"origin":
                origins.append(value.decode("latin-1"))
        bound = "localhost" if not self.any_host else "0.0.0.0"
        return refusal(hosts, origins, bound, scope.get("scheme", "http"), who="aidaptiv-ds studio")

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):  # lifespan: Gradio's queue starts and stops through it
            await self.app(scope, receive, send)
            return
        refused = self.refusal(scope)
        if refused is None:
            await self.app(scope, receive, send)
            return
        status, text = refused
        if scope["type"] == "websocket":  # closed before being accepted: uvicorn answers 403
            await receive()
            await send({"type": "websocket.close", "code": 1008})
            return
        body = (text + "\n").encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"%d" % len(body))],
            }
        )
        await send({"type": "http.response.body", "body": body})


class CannotListen(OSError):
    """The address or port cannot be listened on; str() says which and what to do."""


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address ``host`` names (`localhost`: 127.0.0.1 and ::1 where it exists); raises
    CannotListen when the port is taken or no address can be bound."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise CannotListen(f"cannot listen on --host {host} ({e.strerror}): give an address of this machine") from None
    both_families = {info[0] for info in infos} >= {socket.AF_INET, socket.AF_INET6}
    bound, errors = [], []
    for family, kind, proto, _name, address in dict.fromkeys(infos):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and both_families:  # ::1 beside 127.0.0.1: each on its own socket
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(2048)
            bound.append(sock)
        except OSError as e:
            sock.close()
            errors.append(e)
    if not bound or any(e.errno == errno.EADDRINUSE for e in errors):  # another program has the port
        for sock in bound:
            sock.close()
        e = next((e for e in errors if e.errno == errno.EADDRINUSE), errors[0])
        raise CannotListen(f"cannot listen on {url_for(host, port)} ({e.strerror}): choose another --port or --host")
    return bound


def serve(page, *, host: str, port: int, auth, auth_message: str, max_file_size: str, allowed_paths: list[str]):
    """Serve ``page`` (queued Blocks) on ``host``:``port`` until SIGINT or SIGTERM; what launch() was given
    before: the password check, the upload cap, the root as the one folder files are served from, no SSR,
    errors shown in the page, and no share link (mounting never makes one)."""
    import fastapi
    import gradio as gr
    import uvicorn

    app = fastapi.FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    gr.mount_gradio_app(
        app,
        page,
        path="/",
        server_name=host,
        server_port=port,
        auth=auth,
        auth_message=auth_message,
        max_file_size=max_file_size,
        allowed_paths=allowed_paths,
        ssr_mode=False,
        show_error=True,
    )
    sockets = listening_sockets(host, port)
    where = "every address of this machine" if not is_loopback(host) else "this machine only"
    print(f"aidaptiv-ds studio: open {url_for(host, port)} ({where}); Ctrl-C stops the studio", flush=True)
    from starlette.routing import Mount

    gradio_app = next(route.app for route in app.routes if isinstance(route, Mount))
    config = uvicorn.Config(HostOriginGuard(app, host), log_level="warning", timeout_graceful_shutdown=3)
    stopping_server(config, page, gradio_app).run(sockets=sockets)


def _quiet_cancellations(record) -> bool:
    """False for what uvicorn logs about the requests it cancels at shutdown (open event streams)."""
    exc = record.exc_info[1] if record.exc_info else None
    return not (isinstance(exc, asyncio.CancelledError) or record.getMessage().startswith("Cancel "))


def stopping_server(config, page, gradio_app):
    """A uvicorn.Server that, on Ctrl-C or SIGTERM, first tells Gradio it stops (what Blocks.close() does), so
    its event streams end instead of holding the graceful shutdown; the streams still waiting then are
    cancelled after timeout_graceful_shutdown, without a traceback each."""
    import logging

    import uvicorn

    class StoppingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:
                logging.getLogger("uvicorn.error").addFilter(_quiet_cancellations)
                page._queue.close()
                page.is_running = False
                # a signal handler runs between two steps of the loop: the event is set by the loop itself
                asyncio.get_running_loop().call_soon_threadsafe(gradio_app.stop_event.set)
            super().handle_exit(sig, frame)

    return StoppingServer(config)
