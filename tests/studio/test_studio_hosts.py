"""Who may talk to the studio: a running studio (a child process, as a user starts it) answers only requests
for the names it is bound to and from its own page. A web page whose name resolves to 127.0.0.1 (DNS
rebinding) is refused before Gradio sees the request, and no answer lets another origin read it; the same
request for 127.0.0.1 still works. Also served on IPv6 loopback, and behind a password on every address.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import REPO, child_env

pytest.importorskip("gradio", reason="the studio's packages are not installed: pip install 'aidaptiv-ds[studio]'")

EVIL = "evil.example"


def free_port(family=socket.AF_INET, address="127.0.0.1") -> int:
    with socket.socket(family) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


@contextmanager
def studio(root: Path, *extra: str, connect="127.0.0.1", family=socket.AF_INET, env=None):
    """A studio in a child process, listening on a free port; yields (port, log path)."""
    port = free_port(family, connect)
    log_path = root.parent / f"studio-{port}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aidaptiv_ds", "studio", "--root", str(root), "--port", str(port), *extra],
            cwd=REPO,
            env=env or child_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.time() + 180
            while True:
                assert proc.poll() is None, f"the studio ended (exit {proc.returncode}):\n{log_path.read_text()}"
                try:
                    socket.create_connection((connect, port), timeout=1).close()
                    break
                except OSError:
                    assert time.time() < deadline, "the studio did not start in 180 s:\n" + log_path.read_text()
                    time.sleep(0.5)
            yield port, log_path
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def request(port, method, path, headers, body=None, connect="127.0.0.1"):
    """(status, headers with lower-case names (repeated ones joined by newlines), body) of one request with
    exactly these headers (Host too)."""
    conn = http.client.HTTPConnection(connect, port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        headers: dict[str, str] = {}
        for k, v in r.getheaders():
            headers[k.lower()] = f"{headers[k.lower()]}\n{v}" if k.lower() in headers else v
        return r.status, headers, r.read().decode("utf-8", errors="replace")
    finally:
        conn.close()


def call_on_load(port, host, origin=None, connect="127.0.0.1"):
    """The page's on_load event through Gradio's API, the way the issue's curl sends it."""
    headers = {"Host": host, "Content-Type": "application/json"}
    if origin:
        headers["Origin"] = origin
    return request(port, "POST", "/gradio_api/call/on_load", headers, b'{"data":[]}', connect)


def on_load_result(port, host, event_id, connect="127.0.0.1") -> str:
    status, _, body = request(port, "GET", f"/gradio_api/call/on_load/{event_id}", {"Host": host}, None, connect)
    assert status == 200, body
    return body


@pytest.fixture(scope="module")
def loopback_studio(tmp_path_factory):
    root = tmp_path_factory.mktemp("hosts") / "root"
    (root / "data").mkdir(parents=True)
    (root / "data" / "secret-set.jsonl").write_text('{"text": "not for other pages"}\n')
    with studio(root) as (port, _log):
        yield port


def test_a_rebinding_page_is_refused_and_granted_no_origin(loopback_studio):
    port = loopback_studio
    status, headers, body = call_on_load(port, f"{EVIL}:{port}", f"http://{EVIL}")
    assert status in (403, 421), (status, headers, body)
    assert "access-control-allow-origin" not in headers, headers
    assert "secret-set" not in body and body.count("\n") <= 1 and "studio" in body, body
    # nor the page itself (its config lists the data sets), nor a preflight
    status, headers, body = request(port, "GET", "/config", {"Host": f"{EVIL}:{port}"})
    assert status in (403, 421) and "secret-set" not in body, (status, body)
    status, headers, _ = request(
        port,
        "OPTIONS",
        "/gradio_api/call/on_load",
        {"Host": f"{EVIL}:{port}", "Origin": f"http://{EVIL}", "Access-Control-Request-Method": "POST"},
    )
    assert status in (403, 421) and "access-control-allow-origin" not in headers, (status, headers)


def test_another_origin_is_refused_even_for_the_right_host(loopback_studio):
    """A foreign page that posts to http://127.0.0.1:PORT (plain cross-site requests need no rebinding)."""
    port = loopback_studio
    for origin in (f"http://{EVIL}", "null", f"http://127.0.0.1:{port + 1}"):
        status, headers, body = call_on_load(port, f"127.0.0.1:{port}", origin)
        assert status == 403, (origin, status, headers, body)
        assert "access-control-allow-origin" not in headers, (origin, headers)


def test_the_same_request_for_the_bound_address_still_works(loopback_studio):
    port = loopback_studio
    for host, origin in (
        (f"127.0.0.1:{port}", None),
        (f"127.0.0.1:{port}", f"http://127.0.0.1:{port}"),  # what a browser on the studio's page sends
        (f"localhost:{port}", f"http://localhost:{port}"),
        (f"[::1]:{port}", None),
        (f"LocalHost:{port}", None),
        ("localhost:8080", "http://localhost:8080"),  # through `ssh -L 8080:localhost:PORT`
    ):
        status, headers, body = call_on_load(port, host, origin)
        assert status == 200, (host, origin, status, body)
        assert headers.get("access-control-allow-origin") in (None, origin), headers
        answer = on_load_result(port, host, json.loads(body)["event_id"])
        assert "event: complete" in answer and "data/secret-set.jsonl" in answer, answer


def test_ipv6_loopback_serves_the_page(tmp_path):
    try:
        free_port(socket.AF_INET6, "::1")
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    with studio(tmp_path / "root", "--host", "::1", connect="::1", family=socket.AF_INET6) as (port, log):
        status, _, body = request(port, "GET", "/", {"Host": f"[::1]:{port}"}, connect="::1")
        assert status == 200 and "aidaptiv-ds studio" in body, (status, body[:300])
        status, _, _ = request(port, "GET", "/config", {"Host": f"{EVIL}:{port}"}, connect="::1")
        assert status in (403, 421)
        assert "Traceback" not in log.read_text() and f"http://[::1]:{port}/" in log.read_text(), log.read_text()


def test_every_address_with_a_password_takes_any_name_but_not_other_origins(tmp_path):
    """Bound to 0.0.0.0 the studio cannot know the names it is reached by (a host name, an address, a tunnel),
    so it takes any Host; the password is the check there (a rebinding page has no login for its own name).
    Other origins are refused all the same, and the password still guards the page."""
    password = "correct horse"
    with studio(tmp_path / "root", "--host", "0.0.0.0", env=child_env(AIDAPTIV_STUDIO_PASSWORD=password)) as (
        port,
        _log,
    ):
        host = f"workstation.lab.example:{port}"
        status, _, _ = request(port, "GET", "/config", {"Host": host})
        assert status == 401  # Gradio's answer: not logged in
        status, _, _ = request(
            port,
            "POST",
            "/login",
            {"Host": host, "Content-Type": "application/x-www-form-urlencoded"},
            b"username=anyone&password=wrong",
        )
        assert status == 400
        status, headers, body = request(
            port,
            "POST",
            "/login",
            {"Host": host, "Content-Type": "application/x-www-form-urlencoded"},
            b"username=anyone&password=correct+horse",
        )
        assert status == 200, body
        cookies = "; ".join(c.split(";")[0] for c in headers.get("set-cookie", "").splitlines())
        status, _, body = request(port, "GET", "/config", {"Host": host, "Cookie": cookies})
        assert status == 200, body
        status, headers, _ = request(port, "GET", "/config", {"Host": host, "Cookie": cookies, "Origin": "http://x.y"})
        assert status == 403 and "access-control-allow-origin" not in headers
