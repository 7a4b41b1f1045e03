"""One MQTT v5 connection (paho-mqtt 2.x) for the agent and the client.

What it adds to paho: broker URLs (``mqtt://``, ``mqtts://``) with TLS and credentials
from options, files or the environment (never logged); a first connection that tells a
refusal (bad password, TLS) from a broker that is not up yet; subscriptions remade on
every CONNACK (a restarted broker has forgotten them); reconnects with exponential
backoff; the broker's packet-size limit from the CONNACK; and a clean disconnect.
paho is imported here only, and this module only by ``serve``/``submit`` code paths.
"""

from __future__ import annotations

import logging
import os
import ssl
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

log = logging.getLogger("edgepack.mqtt")

ENV_USERNAME = "EDGEPACK_MQTT_USERNAME"
ENV_PASSWORD = "EDGEPACK_MQTT_PASSWORD"
RECONNECT_MIN_S = 0.5
RECONNECT_MAX_S = 30


class ConnectError(RuntimeError):
    """The broker could not be reached or refused us; the message names no secret."""


@dataclass
class BrokerConfig:
    host: str
    port: int
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    insecure: bool = False  # TLS without hostname verification (self-signed lab setups)
    keepalive: int = 30

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        username: str | None = None,
        password: str | None = None,
        password_file: str | None = None,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        insecure: bool = False,
        keepalive: int = 30,
        env: dict | None = None,
    ) -> BrokerConfig:
        """Credentials: options win over the URL's ``user:pass@``, which wins over
        $EDGEPACK_MQTT_USERNAME / $EDGEPACK_MQTT_PASSWORD."""
        env = os.environ if env is None else env
        u = urlsplit(url if "://" in url else f"mqtt://{url}")
        if u.scheme not in ("mqtt", "mqtts", "tcp", "ssl"):
            raise ValueError(
                f"--broker: scheme {u.scheme!r} not supported; use mqtt:// or mqtts://"
            )
        if not u.hostname:
            raise ValueError("--broker: no host in the URL (expected mqtt://host:port)")
        tls = u.scheme in ("mqtts", "ssl")
        try:
            port = u.port or (8883 if tls else 1883)
        except ValueError:
            raise ValueError("--broker: bad port in the URL") from None
        if password_file:
            try:
                with open(password_file, encoding="utf-8") as f:
                    password = f.readline().rstrip("\r\n")
            except OSError as e:
                raise ValueError(f"--password-file: {e.strerror}: {password_file}") from None
        user = username or (unquote(u.username) if u.username else None) or env.get(ENV_USERNAME)
        pw = password or (unquote(u.password) if u.password else None) or env.get(ENV_PASSWORD)
        for path, what in ((ca, "--ca"), (cert, "--cert"), (key, "--key")):
            if path and not os.path.isfile(path):
                raise ValueError(f"{what}: no such file: {path}")
        if key and not cert:
            raise ValueError("--key needs --cert")
        return cls(u.hostname, port, tls, user, pw, ca, cert, key, insecure, keepalive)

    def describe(self) -> str:
        """For logs: never the password."""
        who = f" as {self.username!r}" if self.username else ""
        cert = " with client certificate" if self.cert else ""
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}{who}{cert}"


class PackedProps:
    """MQTT v5 PUBLISH properties, encoded once. paho only calls ``pack()`` on the
    properties of a publish; its own ``Properties`` class spends ~0.1 ms per message
    looking up property names, a real share of a sub-millisecond job."""

    __slots__ = ("_data",)

    def __init__(
        self,
        content_type: str | None = None,
        correlation: bytes | None = None,
        response_topic: str | None = None,
        user: list[tuple[str, str]] | None = None,
        expiry: int | None = None,
    ) -> None:
        parts = []
        if expiry:
            parts.append(b"\x02" + struct.pack("!I", expiry))  # Message Expiry Interval
        if content_type:
            parts.append(b"\x03" + _utf8(content_type))  # Content Type
        if response_topic:
            parts.append(b"\x08" + _utf8(response_topic))  # Response Topic
        if correlation is not None:
            parts.append(b"\x09" + struct.pack("!H", len(correlation)) + bytes(correlation))
        for k, v in user or ():
            parts.append(b"\x26" + _utf8(k) + _utf8(v))  # User Property
        body = b"".join(parts)
        self._data = _varint(len(body)) + body

    def pack(self) -> bytes:
        return self._data

    def __str__(self) -> str:
        return f"PackedProps({len(self._data)} bytes)"


def _utf8(s: str) -> bytes:
    b = s.encode("utf-8")
    if len(b) > 65535:
        raise ValueError("MQTT string longer than 65535 bytes")
    return struct.pack("!H", len(b)) + b


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, b = divmod(n, 128)
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def props_of(message) -> tuple[str | None, bytes | None, str | None, dict[str, str], int | None]:
    """(ResponseTopic, CorrelationData, ContentType, user properties, expiry) of a paho
    message; all empty for MQTT 3.1.1 publishers."""
    p = getattr(message, "properties", None)
    if p is None:
        return None, None, None, {}, None
    user = {}
    for kv in getattr(p, "UserProperty", None) or ():
        if len(kv) == 2 and kv[0] not in user:
            user[kv[0]] = kv[1]
    return (
        getattr(p, "ResponseTopic", None),
        getattr(p, "CorrelationData", None),
        getattr(p, "ContentType", None),
        user,
        getattr(p, "MessageExpiryInterval", None),
    )


class Connection:
    """A paho client that stays connected. ``subscriptions()`` is called on every
    CONNACK and its (topic, qos) list subscribed; ``on_ready(session_present)`` runs
    once those SUBACKs are in. Callbacks run on paho's network thread."""

    def __init__(
        self,
        cfg: BrokerConfig,
        client_id: str,
        *,
        session_expiry: int,
        clean_start: bool,
        subscriptions: Callable[[], list[tuple[str, int]]] = list,
        on_message: Callable | None = None,
        on_ready: Callable[[bool], None] | None = None,
        on_publish_failed: Callable[[int, str, int], None] | None = None,
        will: tuple[str, bytes] | None = None,
        name: str = "mqtt",
        max_inflight: int = 1000,
    ) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        self._Properties, self._PT = Properties, PacketTypes
        self.cfg, self.client_id, self.name = cfg, client_id, name
        self.session_expiry = session_expiry
        self.subscriptions = subscriptions
        self.on_message_cb, self.on_ready_cb = on_message, on_ready
        self.on_publish_failed = on_publish_failed
        self.max_packet: int | None = None  # the broker's MaximumPacketSize, if it sets one
        self.ready = threading.Event()
        self.ever_connected = False
        self.reconnects = 0
        self._refused: str | None = None
        self._errors: list[str] = []  # paho's error lines before the first CONNACK
        self._first_error_at = 0.0
        self._sub_mids: set[int] = set()
        self._unsub_events: dict[int, threading.Event] = {}
        self._unsubacked: set[int] = set()
        self._session_present = False
        self._closing = False
        c = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=mqtt.MQTTv5,
            reconnect_on_failure=True,
        )
        c.max_inflight_messages_set(max_inflight)
        c.max_queued_messages_set(0)  # unlimited: replies wait out a broker restart
        c.reconnect_delay_set(RECONNECT_MIN_S, RECONNECT_MAX_S)
        if cfg.username is not None:
            c.username_pw_set(cfg.username, cfg.password)
        if cfg.tls:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cfg.ca)
            if cfg.cert:  # without --key the key is read from the certificate's PEM
                ctx.load_cert_chain(cfg.cert, cfg.key)
            if cfg.insecure:
                ctx.check_hostname = False
            c.tls_set_context(ctx)
        if will is not None:
            c.will_set(will[0], will[1], qos=1, retain=True)
        c.on_connect = self._on_connect
        c.on_disconnect = self._on_disconnect
        c.on_subscribe = self._on_subscribe
        c.on_unsubscribe = self._on_unsubscribe
        c.on_message = self._on_message
        c.on_publish = self._on_publish
        c.on_log = self._on_log
        self.client = c
        self._clean_start = clean_start

    # --- lifecycle --------------------------------------------------------------------

    def start(self, timeout: float | None = 30.0, retry: bool = True) -> None:
        """Connect and subscribe; returns once subscribed. A broker that is not
        reachable is retried with backoff until ``timeout`` (None: forever) when
        ``retry``; a refused CONNACK or a TLS failure raises ConnectError at once."""
        props = self._Properties(self._PT.CONNECT)
        props.SessionExpiryInterval = self.session_expiry
        end = None if timeout is None else time.monotonic() + timeout
        delay = RECONNECT_MIN_S
        while True:
            try:
                self.client.connect(
                    self.cfg.host,
                    self.cfg.port,
                    keepalive=self.cfg.keepalive,
                    clean_start=self._clean_start,
                    properties=props,
                )
                break
            except ssl.SSLError as e:
                raise ConnectError(
                    f"TLS handshake with {self.cfg.describe()} failed: {e.reason or e}"
                ) from None
            except OSError as e:
                msg = f"cannot reach broker {self.cfg.describe()}: {e.strerror or e}"
                if not retry or (end is not None and time.monotonic() + delay > end):
                    raise ConnectError(msg) from None
                log.warning("%s; retrying in %.1f s", msg, delay)
                time.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX_S)
        self.client.loop_start()
        while not self.ready.wait(0.05):
            why = self._refused
            if why is None and not self.ever_connected and self._errors:
                # Closed before any CONNACK: a TLS alert (e.g. no client certificate).
                # The first attempt may only say "EOF"; the alert comes with the next.
                alert = [e for e in self._errors if "alert" in e.lower()]
                if alert or time.monotonic() - self._first_error_at > 2.0:
                    why = (alert or self._errors)[0]
            if why is not None or (end is not None and time.monotonic() > end):
                self._closing = True
                self.client.disconnect()
                self.client.loop_stop()
                if why is None:
                    raise ConnectError(
                        f"no answer from broker {self.cfg.describe()} within {timeout:g} s"
                    )
                raise ConnectError(f"broker {self.cfg.describe()} refused the connection: {why}")

    def stop(self, session_expiry: int | None = None, timeout: float = 5.0) -> None:
        """Disconnect cleanly (no last will) after queued publishes are out.
        ``session_expiry`` replaces the session's expiry (0 ends the session now)."""
        self._closing = True
        end = time.monotonic() + timeout
        while self.client.is_connected() and self.pending_publishes() and time.monotonic() < end:
            time.sleep(0.01)
        props = None
        if session_expiry is not None:
            props = self._Properties(self._PT.DISCONNECT)
            props.SessionExpiryInterval = session_expiry
        try:
            self.client.disconnect(properties=props)
        finally:
            self.client.loop_stop()

    @property
    def closing(self) -> bool:
        return self._closing

    def pending_publishes(self) -> int:
        return len(self.client._out_messages)  # paho keeps QoS>0 messages here until acked

    # --- publishing -------------------------------------------------------------------

    def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        content_type: str | None = None,
        correlation: bytes | None = None,
        response_topic: str | None = None,
        user: list[tuple[str, str]] | None = None,
        expiry: int | None = None,
    ):
        props = None
        if content_type or correlation is not None or response_topic or user or expiry:
            props = PackedProps(content_type, correlation, response_topic, user, expiry)
        return self.client.publish(topic, payload, qos=qos, retain=retain, properties=props)

    def subscribe(self, topic: str, qos: int = 1) -> None:
        self.client.subscribe(topic, qos)

    def unsubscribe(self, topic: str, wait: float = 0.0) -> None:
        """Unsubscribe; with ``wait``, block until the UNSUBACK (so every message the
        broker routed to us before it has been through on_message: TCP keeps order)."""
        done = threading.Event()
        rc, mid = self.client.unsubscribe(topic)
        if wait <= 0 or rc != 0:
            return
        self._unsub_events[mid] = done
        if mid in self._unsubacked:  # the UNSUBACK beat us here
            done.set()
        if not done.wait(wait):
            log.warning("%s: no UNSUBACK for %s within %.1f s", self.name, topic, wait)
        self._unsub_events.pop(mid, None)
        self._unsubacked.discard(mid)

    # --- paho callbacks (network thread) -------------------------------------------------

    def _on_connect(self, client, userdata, flags, rc, props) -> None:
        if rc.is_failure:
            self._refused = str(rc)
            log.error("%s: broker refused the connection: %s", self.name, rc)
            return
        self._refused = None
        # on_log makes paho format a debug line (properties included) for every packet:
        # costly. It is only there to catch why a first connection fails.
        client.on_log = None
        _no_delay(client)
        if self.ever_connected:
            self.reconnects += 1
            log.warning(
                "%s: reconnected to %s (session %s)",
                self.name,
                self.cfg.describe(),
                "resumed" if flags.session_present else "new",
            )
        self.ever_connected = True
        self._session_present = bool(flags.session_present)
        mps = getattr(props, "MaximumPacketSize", None) if props is not None else None
        self.max_packet = int(mps) if mps else None
        subs = self.subscriptions()
        if not subs:
            self._set_ready()
            return
        rc2, mid = client.subscribe([(t, q) for t, q in subs])
        self._sub_mids = {mid}

    def _on_subscribe(self, client, userdata, mid, rcs, props) -> None:
        for r in rcs:
            if r.is_failure:
                log.error("%s: subscription refused by the broker: %s", self.name, r)
        if mid in self._sub_mids:
            self._sub_mids.discard(mid)
            self._set_ready()

    def _on_unsubscribe(self, client, userdata, mid, rcs, props) -> None:
        self._unsubacked.add(mid)
        ev = self._unsub_events.get(mid)
        if ev is not None:
            ev.set()

    def _set_ready(self) -> None:
        self.ready.set()
        if self.on_ready_cb is not None:
            try:
                self.on_ready_cb(self._session_present)
            except Exception:
                log.exception("%s: on_ready failed", self.name)

    def _on_disconnect(self, client, userdata, flags, rc, props) -> None:
        self.ready.clear()
        if not self._closing and self.ever_connected:
            log.warning("%s: connection lost (%s); reconnecting with backoff", self.name, rc)

    def _on_message(self, client, userdata, message) -> None:
        if self.on_message_cb is None:
            return
        try:
            self.on_message_cb(message)
        except Exception:  # never let one message kill paho's network thread
            log.exception("%s: message handler failed on %s", self.name, message.topic)

    def _on_publish(self, client, userdata, mid, rc, props) -> None:
        # rc 16 "No matching subscribers" is a success code but worth knowing.
        if (rc.is_failure or rc.value == 16) and self.on_publish_failed is not None:
            self.on_publish_failed(mid, str(rc), rc.value)

    def _on_log(self, client, userdata, level, buf) -> None:
        import paho.mqtt.client as mqtt

        if level == mqtt.MQTT_LOG_ERR and "not connected" not in buf:
            if not self._errors:
                self._first_error_at = time.monotonic()
            self._errors.append(buf.replace("failed to receive on socket: ", ""))
            log.debug("%s: paho: %s", self.name, buf)


def _no_delay(client) -> None:
    """paho leaves Nagle's algorithm on: with delayed ACKs every small publish can
    wait ~40 ms on loopback. (The broker needs ``set_tcp_nodelay true`` too.)"""
    import socket

    sock = client.socket()
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError):  # not TCP (e.g. a websocket or unix socket)
        pass
