"""Test helpers for the MQTT agent: a real Mosquitto on 127.0.0.1, agent processes,
a status watcher, TLS material. Used by tests/test_mqtt*.py and scripts/bench_mqtt.py.

Every broker gets its own config file in a temporary folder and a free port; every
process started here is registered and killed by ``cleanup()`` (the fixtures call it),
so a failing test leaves nothing running.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from conftest import cli_env

HOST = "127.0.0.1"
_PROCS: list[subprocess.Popen] = []


def have_mosquitto() -> bool:
    return shutil.which("mosquitto") is not None


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with socket.create_connection((HOST, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nothing listening on {HOST}:{port} after {timeout} s")


def _track(p: subprocess.Popen) -> subprocess.Popen:
    _PROCS.append(p)
    return p


def cleanup() -> None:
    """Kill every process these helpers started (brokers and agents) and reap them."""
    while _PROCS:
        p = _PROCS.pop()
        if p.poll() is None:
            p.kill()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


class Broker:
    """``mosquitto -c <own config>`` in the foreground, on a free 127.0.0.1 port."""

    def __init__(
        self,
        workdir: Path,
        *,
        tls: dict | None = None,
        password_file: Path | None = None,
        acl_file: Path | None = None,
        max_packet_size: int | None = None,
        nodelay: bool = True,
    ) -> None:
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.tls = tls
        self.log_path = self.dir / "mosquitto.log"
        lines = []
        if os.geteuid() == 0:
            lines.append("user root")  # else mosquitto drops to a user that cannot read our files
        lines += [
            f"listener {self.port} {HOST}",
            f"allow_anonymous {'false' if password_file else 'true'}",
            "persistence false",
            "max_queued_messages 100000",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "log_type information",
            f"log_dest file {self.log_path}",
        ]
        if nodelay:
            # Mosquitto's default leaves Nagle on: ~40 ms per small reply (docs/protocol.md)
            lines.append("set_tcp_nodelay true")
        if password_file:
            lines.append(f"password_file {password_file}")
        if acl_file:
            lines.append(f"acl_file {acl_file}")
        if max_packet_size:
            lines.append(f"max_packet_size {max_packet_size}")
        if tls:
            lines += [
                f"cafile {tls['ca']}",
                f"certfile {tls['server_cert']}",
                f"keyfile {tls['server_key']}",
                "require_certificate true",
                "tls_version tlsv1.2",
            ]
        self.config = self.dir / "mosquitto.conf"
        self.config.write_text("\n".join(lines) + "\n")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://{HOST}:{self.port}"

    def start(self) -> Broker:
        self.proc = _track(
            subprocess.Popen(
                ["mosquitto", "-c", str(self.config)],
                stdout=subprocess.DEVNULL,
                stderr=open(self.dir / "mosquitto.stderr", "ab"),
            )
        )
        wait_port(self.port)
        return self

    def kill(self) -> None:
        """SIGKILL: no clean shutdown, every session and retained message is gone."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class Agent:
    """``edgepack serve`` as a child process (so SIGKILL is real)."""

    def __init__(
        self,
        bundle: Path,
        broker_url: str | None,
        device: str,
        *args: str,
        logdir: Path,
        env: dict | None = None,
    ) -> None:
        """``broker_url`` None: no MQTT (an HTTP-only server, ``--http`` in ``args``)."""
        self.device = device
        self.log_path = Path(logdir) / f"agent-{device}.log"
        broker = ["--broker", broker_url] if broker_url else []
        cmd = [sys.executable, "-m", "edgepack.cli", "serve", str(bundle), *broker,
               "--device", device, "--threads", "1", *args]  # fmt: skip
        self.proc = _track(
            subprocess.Popen(
                cmd,
                stdout=open(self.log_path, "ab"),
                stderr=subprocess.STDOUT,
                env=cli_env(env),
            )
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def terminate(self, timeout: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss_kb(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise RuntimeError("no VmRSS")


def mqtt_client(url: str, client_id: str, *, protocol: str = "v5", **tls_auth):
    """A plain paho client (not edgepack's), connected and looping. ``tls_auth``:
    username, password, ca, cert, key."""
    import ssl

    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    proto = mqtt.MQTTv5 if protocol == "v5" else mqtt.MQTTv311
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=proto)
    if tls_auth.get("username"):
        c.username_pw_set(tls_auth["username"], tls_auth.get("password"))
    if url.startswith("mqtts"):
        ctx = ssl.create_default_context(cafile=tls_auth.get("ca"))
        if tls_auth.get("cert"):
            ctx.load_cert_chain(tls_auth["cert"], tls_auth.get("key"))
        c.tls_set_context(ctx)
    connected = threading.Event()
    c.on_connect = lambda cl, ud, flags, rc, props: connected.set() if not rc.is_failure else None
    port = int(url.rsplit(":", 1)[1])
    c.connect(HOST, port)
    c.loop_start()
    if not connected.wait(10):
        c.loop_stop()
        raise TimeoutError(f"{client_id}: no CONNACK from {url}")
    return c


class StatusWatcher:
    """Follows every device's retained status (``<prefix>/dev/+/status``)."""

    def __init__(self, url: str, prefix: str = "edgepack/v1", **tls_auth) -> None:
        self.status: dict[str, dict] = {}
        self.history: list[tuple[str, str]] = []
        self._cv = threading.Condition()
        self.client = mqtt_client(url, f"watch-{os.getpid()}-{free_port()}", **tls_auth)
        self.client.on_message = self._on_message
        self.client.on_connect = lambda c, ud, f, rc, p: c.subscribe(f"{prefix}/dev/+/status", 1)
        self.client.subscribe(f"{prefix}/dev/+/status", 1)

    def _on_message(self, client, userdata, msg) -> None:
        try:
            s = json.loads(msg.payload)
        except ValueError:
            return
        with self._cv:
            self.status[s["device"]] = s
            self.history.append((s["device"], s["state"]))
            self._cv.notify_all()

    def wait(
        self, device: str, state: str, timeout: float = 240.0, agent: Agent | None = None
    ) -> dict:
        # generous: a fresh agent compiles its kernels first, and on a cold numba cache
        # with the other test workers compiling too that took over 60 s
        end = time.monotonic() + timeout
        with self._cv:
            while self.status.get(device, {}).get("state") != state:
                if agent is not None and agent.proc.poll() is not None and state == "online":
                    raise RuntimeError(f"agent {device} exited:\n{agent.log()[-3000:]}")
                left = end - time.monotonic()
                if left <= 0:
                    log = agent.log()[-3000:] if agent else ""
                    raise TimeoutError(f"{device} not {state} after {timeout} s\n{log}")
                self._cv.wait(min(left, 0.2))
            return self.status[device]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def make_tls(d: Path, clients: tuple[str, ...] = ("client",)) -> dict:
    """A CA, a server certificate for 127.0.0.1 and client certificates (CN = name),
    with the openssl command line. EC keys: quick to make."""
    d.mkdir(parents=True, exist_ok=True)

    def ossl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ossl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
         "-subj", "/CN=edgepack test CA")  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    out = {"ca": str(d / "ca.crt")}
    for name, ext in [("server", ["-extfile", "san.ext"])] + [(c, []) for c in clients]:
        ossl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        ossl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", *ext)  # fmt: skip
        out[f"{name}_cert"], out[f"{name}_key"] = str(d / f"{name}.crt"), str(d / f"{name}.key")
    return out


_BUNDLES: dict[tuple, Path] = {}


def digits_bundle(base: Path, batch: int = 1, quant: str = "fp32") -> Path:
    """The digits CNN packed once per test process (fp32, batch ``batch``)."""
    from conftest import DATA, pack

    key = (batch, quant)
    if key not in _BUNDLES:
        out = Path(base) / f"digits-b{batch}-{quant}.epk"
        shapes = {"image": (batch, 1, 8, 8)} if batch != 1 else None
        _BUNDLES[key] = pack(DATA / "digits_cnn.onnx", out, quant=quant, input_shapes=shapes)
    return _BUNDLES[key]


def digits_ref_rows(session, x: np.ndarray) -> np.ndarray:
    """What ``edgepack run`` gives for each row of ``x`` (batch bundles: the row in a
    zero-padded batch, which is how the agent runs a part-full batch)."""
    b = session.inputs[0]["shape"][0]
    out = []
    for row in x:
        z = np.zeros((b, 1, 8, 8), np.float32)
        z[0] = row
        out.append(session.run({"image": z})["logits"][0])
    return np.stack(out)


def digits_inputs() -> np.ndarray:
    """Real inputs: the scikit-learn digits test split, float32 [N, 1, 8, 8]."""
    import train_digits

    return train_digits.load_split()[1]
