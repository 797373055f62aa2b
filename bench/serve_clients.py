"""`aidaptiv-ds serve` under 1, 4 and 16 concurrent clients: tokens/s over all clients and each request's time to
its first token, with the model's weights streamed from the swap space (a host budget below the model's size).

    python bench/serve_clients.py --model MODEL --out bench/results/serve_clients/smollm2-135m \\
        [--host-budget 96MiB] [--clients 1,4,16] [--requests 2] [--max-tokens 32]

Each client sends ``--requests`` streamed chat requests one after another (a question of its own, greedy) through
the openai client; the server batches what arrives together (--max-batch 16, --batch-wait-ms 20). One row per
client count in OUT/rows.jsonl (the server's batch counters, every request's time to first token and tokens),
OUT/summary.md made from the rows. Run it on a quiet machine: the figures are the server's and the disk's.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
QUESTIONS = [
    "What is the capital of {}?",
    "Name one famous dish from {}.",
    "What language is spoken in {}?",
    "Describe the weather in {} in one sentence.",
]
PLACES = ["France", "Italy", "Spain", "Japan", "Kenya", "Peru", "Norway", "Egypt", "India", "Canada", "Chile",
          "Greece", "Vietnam", "Morocco", "Ireland", "Mexico"]  # fmt: skip


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_level(client_cls, base_url: str, clients: int, requests: int, max_tokens: int) -> dict:
    done, lock = [], threading.Lock()

    def client(c: int) -> None:
        api = client_cls(base_url=base_url, api_key="unused")
        for r in range(requests):
            q = QUESTIONS[(c + r) % len(QUESTIONS)].format(PLACES[c % len(PLACES)])
            t0 = time.perf_counter()
            first, tokens = None, 0
            stream = api.chat.completions.create(
                model="bench", messages=[{"role": "user", "content": q}], max_tokens=max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True},
            )  # fmt: skip
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content and first is None:
                    first = time.perf_counter() - t0
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
            with lock:
                done.append({"client": c, "ttft_s": first, "tokens": tokens, "wall_s": time.perf_counter() - t0})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfts = [d["ttft_s"] for d in done if d["ttft_s"] is not None]
    return {
        "clients": clients,
        "requests": len(done),
        "wall_s": round(wall, 2),
        "tokens": sum(d["tokens"] for d in done),
        "tokens_per_s": round(sum(d["tokens"] for d in done) / wall, 2),
        "ttft_median_s": round(statistics.median(ttfts), 3) if ttfts else None,
        "ttft_max_s": round(max(ttfts), 3) if ttfts else None,
        "each": done,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "serve_clients", "smollm2-135m"))
    ap.add_argument("--host-budget", default="96MiB")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--work", default=os.path.join(ROOT, ".bench_work", "serve_clients"))
    args = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    from openai import OpenAI

    from aidaptiv_ds.harness.machine import cpu_line, machine_info
    from aidaptiv_ds.harness.results import git_state

    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    port = _port()
    cmd = [sys.executable, "-m", "aidaptiv_ds", "serve", "--model", args.model, "--port", str(port),
           "--served-model-name", "bench", "--host-budget", args.host_budget, "--nvme-path", args.work,
           "--max-batch", "16", "--batch-wait-ms", "20", "--device", "cpu"]  # fmt: skip
    log = open(os.path.join(args.work, "serve.log"), "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.time() + 600
        while True:
            if server.poll() is not None or time.time() > deadline:
                raise SystemExit("serve did not start:\n" + open(log.name).read()[-3000:])
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        base = f"http://127.0.0.1:{port}/v1"
        machine = machine_info(args.work)
        one_level(OpenAI, base, 1, 1, 4)  # the first request pays for lazy set-up: not measured
        rows = []
        for clients in [int(c) for c in args.clients.split(",")]:
            before = json.loads(subprocess.run(["curl", "-s", f"http://127.0.0.1:{port}/health"], capture_output=True,
                                               text=True).stdout)  # fmt: skip
            level = one_level(OpenAI, base, clients, args.requests, args.max_tokens)
            after = json.loads(subprocess.run(["curl", "-s", f"http://127.0.0.1:{port}/health"], capture_output=True,
                                              text=True).stdout)  # fmt: skip
            level["batches"] = after["batches"] - before["batches"]
            level["largest_batch"] = after["largest_batch"]
            row = {**level, "model": args.model, "host_budget": args.host_budget, "max_tokens": args.max_tokens,
                   "machine": f"{cpu_line(machine)}, {machine.get('threads')} threads", "git_sha": git_state()[0],
                   "command": shlex.join(cmd[1:4] + cmd[6:]), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}  # fmt: skip
            rows.append(row)
            with open(os.path.join(args.out, "rows.jsonl"), "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{clients} clients: {row['tokens_per_s']} tokens/s, first token after {row['ttft_median_s']} s "
                  f"(median), {row['batches']} batches", file=sys.stderr)  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    lines = [
        "# aidaptiv-ds serve under concurrent clients",
        "",
        f"Model {rows[0]['model']}, host budget {rows[0]['host_budget']} (the weights streamed from the swap space), "
        f"{rows[0]['max_tokens']} new tokens a request, greedy, streamed chat; machine: {rows[0]['machine']}; "
        f"git {rows[0]['git_sha']}.",
        f"Command: `python bench/serve_clients.py {shlex.join(argv if argv is not None else sys.argv[1:])}`.",
        "",
        "| clients | requests | tokens/s (all clients) | first token, median | first token, slowest | batches |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['clients']} | {r['requests']} | {r['tokens_per_s']} | {r['ttft_median_s']} s | {r['ttft_max_s']} s "
            f"| {r['batches']} |"
        )
    with open(os.path.join(args.out, "summary.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
