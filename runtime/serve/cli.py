"""Options and handler of ``edgepack serve``, and the broker options ``submit`` shares.

Only argparse here at import time: ``runtime/cli.py`` builds its parser from this module
for every command, and the agent (and paho) are imported when ``serve`` runs.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
from pathlib import Path

ENV_BROKER = "EDGEPACK_MQTT_BROKER"


def size_arg(v: str) -> int:
    """Bytes, with an optional K/M/G suffix (binary): 16M = 16 MiB."""
    m = re.fullmatch(r"(\d+)([KMG]?)i?B?", v.strip(), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {v!r} (e.g. 65536, 64K, 16M)")
    n = int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]
    if n < 1024:
        raise argparse.ArgumentTypeError(f"must be at least 1K, got {v}")
    return n


def _nonneg_float(v: str) -> float:
    x = float(v)
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return x


def _pos_int(v: str) -> int:
    n = int(v)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return n


def add_broker_arguments(p: argparse.ArgumentParser, required: bool = True) -> None:
    g = p.add_argument_group("broker")
    g.add_argument(
        "--broker",
        default=os.environ.get(ENV_BROKER),
        required=required and ENV_BROKER not in os.environ,
        metavar="URL",
        help=f"mqtt://host[:1883] or mqtts://host[:8883] (default: ${ENV_BROKER})"
        + ("" if required else "; serve needs --broker, --http or both"),
    )
    g.add_argument("--username", help="broker username (default: $EDGEPACK_MQTT_USERNAME)")
    g.add_argument(
        "--password",
        help="broker password; visible to other local users in the process list, prefer "
        "--password-file or $EDGEPACK_MQTT_PASSWORD",
    )
    g.add_argument(
        "--password-file", metavar="FILE", help="read the password from FILE's first line"
    )
    g.add_argument("--ca", metavar="PEM", help="CA certificate(s) to verify the broker (mqtts)")
    g.add_argument("--cert", metavar="PEM", help="client certificate (mqtts)")
    g.add_argument("--key", metavar="PEM", help="client private key (mqtts; default: in --cert)")
    g.add_argument(
        "--insecure", action="store_true", help="mqtts: do not check the broker's host name"
    )
    g.add_argument("--prefix", default="edgepack/v1", help="topic prefix (default edgepack/v1)")


def broker_config(a: argparse.Namespace):
    from .conn import BrokerConfig

    return BrokerConfig.from_url(
        a.broker,
        username=a.username,
        password=a.password,
        password_file=a.password_file,
        ca=a.ca,
        cert=a.cert,
        key=a.key,
        insecure=a.insecure,
    )


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Everything but the bundle and --threads (runtime/cli.py adds those)."""
    add_broker_arguments(p, required=False)
    g = p.add_argument_group("http (docs/http.md)")
    g.add_argument("--http", metavar="HOST:PORT", type=_host_port,
                   help="also (or only) serve HTTP: KServe v2, /health, /metrics")  # fmt: skip
    g.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on HTTP (repeatable); visible in "
                        "the process list, prefer --api-key-file or $EDGEPACK_API_KEY")  # fmt: skip
    g.add_argument("--api-key-file", metavar="FILE", help="API keys, one per line")
    g.add_argument("--tls-cert", metavar="PEM", help="serve HTTPS with this certificate")
    g.add_argument("--tls-key", metavar="PEM", help="the certificate's private key")
    g = p.add_argument_group("language models (docs/http.md)")
    g.add_argument("--slots", type=_pos_int, metavar="N",
                   help="sequences generated at once, each in a KV-cache slot (default: all "
                        "the bundle's slots, set at build time with --slots)")  # fmt: skip
    g.add_argument("--batch-invariant", action="store_true",
                   help="run every decode step on the graph of --slots rows, so a sequence's "
                        "tokens never depend on what runs beside it (slower for few "
                        "streams)")  # fmt: skip
    g.add_argument("--max-tokens", type=_pos_int, metavar="N",
                   help="most tokens one request may ask for (default: the context)")  # fmt: skip
    g.add_argument("--no-prompt-cache", dest="prompt_cache", action="store_false",
                   help="compute every prompt in full: no reuse of a KV-cache slot's earlier "
                        "tokens, no sharing of another request's (the time to first token "
                        "then says nothing about other requests' prompts)")  # fmt: skip
    g = p.add_argument_group("identity")
    g.add_argument("--device", help="device id: its job topic and client id (default: host name)")
    g.add_argument(
        "--model",
        help="model name of the fleet topic (default: the model's name in the bundle, i.e. "
        "the ONNX file's stem at build time)",
    )
    g.add_argument("--group", default="fleet", help="shared-subscription group (default fleet)")
    g.add_argument(
        "--no-fleet", action="store_true", help="take per-device jobs only (no shared subscription)"
    )
    g = p.add_argument_group("scheduling")
    g.add_argument(
        "--workers", type=_pos_int, default=1, help="concurrent runs, one arena each (default 1)"
    )
    g.add_argument(
        "--queue",
        type=_pos_int,
        default=256,
        help="max accepted, unfinished jobs; more get 'busy' (default 256)",
    )
    g.add_argument(
        "--max-wait-ms",
        type=_nonneg_float,
        default=2.0,
        help="batched bundles: wait this long for more rows before running a part-full "
        "batch (default 2)",
    )
    g.add_argument("--no-batching", action="store_true", help="never combine jobs into one run")
    g.add_argument(
        "--inline-max-ms",
        type=_nonneg_float,
        default=1.0,
        help="when runs take less than this and nothing is queued, run a job on the network "
        "thread (saves two thread hand-offs); 0: always use the workers (default 1)",
    )
    g.add_argument(
        "--max-job-bytes",
        type=size_arg,
        default=16 << 20,
        help="largest job accepted (default 16M)",
    )
    g = p.add_argument_group("sessions")
    g.add_argument(
        "--session-expiry",
        type=int,
        default=3600,
        metavar="S",
        help="keep per-device jobs in the broker this long while offline (default 3600)",
    )
    g.add_argument(
        "--dedup-ttl",
        type=_nonneg_float,
        default=600.0,
        metavar="S",
        help="answer a re-sent job id from memory for this long (default 600)",
    )
    g.add_argument(
        "--drain-timeout",
        type=_nonneg_float,
        default=30.0,
        metavar="S",
        help="on SIGTERM, finish queued jobs for at most S seconds (default 30)",
    )
    g.add_argument(
        "--metrics-interval",
        type=_nonneg_float,
        default=10.0,
        metavar="S",
        help="publish metrics every S seconds; 0: never (default 10)",
    )
    g.add_argument(
        "--connect-timeout",
        type=_nonneg_float,
        default=0.0,
        metavar="S",
        help="give up if the broker is unreachable for S seconds at start; 0: keep trying "
        "(default)",
    )
    g.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def _host_port(v: str) -> tuple[str, int]:
    host, sep, port = v.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (e.g. 0.0.0.0:8080), got {v!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def _api_keys(a: argparse.Namespace) -> tuple[str, ...]:
    keys = list(a.api_key)
    if os.environ.get("EDGEPACK_API_KEY"):
        keys.append(os.environ["EDGEPACK_API_KEY"])
    if a.api_key_file:
        with open(a.api_key_file) as f:
            keys += [line.strip() for line in f if line.strip()]
        if not keys:
            raise ValueError(f"--api-key-file {a.api_key_file}: no key in it")
    return tuple(keys)


def _model_name(session, bundle) -> str:
    """The name recorded at build time (the ONNX file's stem), so a bundle and its
    executables for every target serve one fleet topic; else the file's stem."""
    name = session.manifest.get("model", {}).get("name")
    if not name:
        name = Path(str(getattr(bundle, "path", bundle))).name.split(".")[0]
    return re.sub(r"[^A-Za-z0-9._-]", "-", name)[:64] or "model"


# How long a thread waiting for the GIL lets its holder run before it asks for it. The
# kernels hold the GIL while they run (pycc's wrappers keep it), so a busy engine thread
# gives the fronts' threads the interpreter only when they ask, and a front thread
# waits an interval again after each call that gives it back (every socket write and
# poll). The engine also gives it back once a turn (the wake-up of the HTTP loop) and
# takes it again at once, which resets the waiter's count: at Python's default of 5 ms,
# and at 0.5 ms, a tiny model's 0.24 ms turns kept the HTTP thread out for most of a
# second (/health answered in up to 0.9 s during a stream, and a client that left was
# noticed after all its 4000 tokens). At 0.1 ms /health takes at most 55-104 ms and the
# client's leaving is noticed within 60 ms; SmolLM2-135M at 8 streams gave 747-818
# tok/s against 681-699 at the default (1 stream the same within noise). Tensor bundles
# keep the default: the digits CNN, one request at a time, ran 1198-1252 v2 requests/s
# and 782-921 MQTT jobs/s at 5 ms against 1016-1017 and 619-710 at 0.1 ms (more
# hand-overs between the network and worker threads for runs of microseconds).
LLM_SWITCH_INTERVAL_S = 0.0001


def cmd_serve(a: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, a.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from ..cli_io import open_session  # the bundle resolution of run/info/bench
    from .protocol import NAME_RE
    from .service import Service, ServiceConfig

    if not a.broker and not a.http:
        raise ValueError(f"serve needs --broker URL (or ${ENV_BROKER}), --http HOST:PORT, or both")
    if bool(a.tls_cert) != bool(a.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    keys = _api_keys(a)
    from ..cli_io import pubkey
    from ..session import open_located

    # opened (signature checked, weights verified) once, whichever kind it is
    located = open_located(a.bundle, pubkey(a), getattr(a, "verify_weights", True))
    llm = "llm" in located.manifest
    if llm:
        sys.setswitchinterval(LLM_SWITCH_INTERVAL_S)
    session = located if llm else open_session(a, located)
    model = a.model or _model_name(session, a.bundle)
    device = a.device or None
    for value, what in ((device, "--device"), (model, "--model"), (a.group, "--group")):
        if value is not None and not NAME_RE.match(value):
            raise ValueError(
                f"{what} {value!r}: use 1 to 64 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
    if not a.prefix or any(c in a.prefix for c in "+#") or a.prefix.startswith(("$", "/")):
        raise ValueError(f"--prefix {a.prefix!r}: no wildcards, no leading '/' or '$'")
    scfg = ServiceConfig(
        workers=a.workers,
        max_queue=a.queue,
        max_wait_ms=a.max_wait_ms,
        batching=not a.no_batching,
        max_job_bytes=a.max_job_bytes,
        drain_timeout=a.drain_timeout,
        threads=a.threads,
        inline_max_ms=a.inline_max_ms,
    )
    if llm:
        from .service import LLMService

        service = LLMService(session, model, scfg, slots=a.slots, max_tokens=a.max_tokens,
                             batch_invariant=a.batch_invariant,
                             prompt_cache=a.prompt_cache)  # fmt: skip
    else:
        service = Service(session, model, scfg)
    agent = http = None
    if a.broker:
        from .agent import Agent, AgentConfig, default_device_id

        agent = Agent(service, AgentConfig(
            broker=broker_config(a),
            device=device or default_device_id(),
            model=model,
            group=a.group,
            fleet=not a.no_fleet,
            prefix=a.prefix.rstrip("/"),
            session_expiry=a.session_expiry,
            metrics_interval=a.metrics_interval,
            dedup_ttl=a.dedup_ttl,
            connect_timeout=a.connect_timeout or None,
        ))  # fmt: skip
    if a.http:
        from .http import HttpConfig, HttpServer

        host, port = a.http
        http = HttpServer(service, HttpConfig(host, port, keys, a.tls_cert, a.tls_key))
    stop = threading.Event()
    started = threading.Event()

    def on_signal(signum, frame) -> None:
        if not started.is_set():
            raise SystemExit(128 + signum)  # still connecting: nothing accepted yet
        if stop.is_set():
            logging.getLogger("edgepack.serve").error("second signal: exiting without draining")
            os._exit(1)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        if http is not None:
            http.start()
        if agent is not None:
            from .conn import ConnectError

            try:
                agent.start()
            except ConnectError as e:
                print(f"edgepack: error: {e}", file=sys.stderr)
                return 1
    except RuntimeError as e:
        print(f"edgepack: error: {e}", file=sys.stderr)
        return 1
    started.set()
    if agent is not None:
        agent.serve_forever(stop)
    else:
        stop.wait()
    # Both fronts stop taking work, then the one queue drains: HTTP requests in flight
    # get their answers while uvicorn waits for them.
    if http is not None:
        http.stop_accepting()
    if agent is not None:
        agent.shutdown()  # leaves the fleet, drains the service, goes offline
    else:
        service.close()
    if http is not None:
        http.join(timeout=10.0)
    return 0
