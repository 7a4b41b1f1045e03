"""``edgepack serve --http``: the Open Inference Protocol (KServe v2 REST) with the
real ``tritonclient[http]`` and httpx, against a server process started here. Answers
equal the local runtime's bit for bit; the errors get their HTTP statuses; the API key,
the body limit, the queue limit (429 with Retry-After), TLS, Prometheus metrics; one
process serving MQTT and HTTP from one queue; SIGTERM answers the requests in flight."""

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import time
from types import SimpleNamespace

import httpx
import mqtt_broker as mb
import numpy as np
import pytest
from conftest import load

pytestmark = pytest.mark.http

KEY = "test-key-0123456789"
HLEN = "Inference-Header-Content-Length"


def _wait_ready(url: str, server: mb.Agent, timeout: float = 90.0, **kw) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if server.proc.poll() is not None:
            raise RuntimeError(f"serve exited {server.proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{url}/health", timeout=1, **kw).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready:\n{server.log()}")


def _serve(bundle, d, name: str, *args: str, broker: str | None = None, scheme: str = "http",
           **kw) -> tuple[mb.Agent, str]:  # fmt: skip
    port = mb.free_port()
    s = mb.Agent(bundle, broker, name, "--http", f"127.0.0.1:{port}", *args, logdir=d)
    url = f"{scheme}://127.0.0.1:{port}"
    _wait_ready(url, s, **kw)
    return s, url


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    d = tmp_path_factory.mktemp("http")
    b1, b4 = mb.digits_bundle(base, 1), mb.digits_bundle(base, 4)
    try:
        s1, url1 = _serve(b1, d, "h1", "--model", "digits")
        # a batched bundle with a queue of 2 and a slow batching window: a third
        # request finds the queue full; requests are refused without the key
        s4, url4 = _serve(b4, d, "h4", "--model", "digits4", "--queue", "2",
                          "--max-wait-ms", "300", "--api-key", KEY)  # fmt: skip
        yield SimpleNamespace(dir=d, b1=b1, b4=b4, s1=s1, url1=url1, s4=s4, url4=url4,
                              ref1=load(b1), ref4=load(b4), X=mb.digits_inputs())  # fmt: skip
    finally:
        mb.cleanup()


def _triton(url: str, **kw):
    import tritonclient.http as th

    return th, th.InferenceServerClient(url.split("://", 1)[1], **kw)


@pytest.mark.parametrize("binary", [False, True])
def test_tritonclient_infer_equals_local_run(env, binary):
    th, c = _triton(env.url1)
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("digits")
    meta = c.get_model_metadata("digits")
    assert meta["inputs"] == [{"name": "image", "datatype": "FP32", "shape": [1, 1, 8, 8]}]
    assert meta["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [1, 10]}]
    for i in range(5):
        x = env.X[i : i + 1]
        inp = th.InferInput("image", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=binary)
        out = th.InferRequestedOutput("logits", binary_data=binary)
        res = c.infer("digits", [inp], outputs=[out], request_id=f"r{i}")
        y = res.as_numpy("logits")
        assert y.dtype == np.float32
        assert np.array_equal(y, env.ref1.run({"image": x})["logits"])
        assert res.get_response()["id"] == f"r{i}"


def test_batched_bundle_takes_any_row_count(env):
    th, c = _triton(env.url4, verbose=False)
    x = env.X[:7]  # 7 rows on a bundle of batch 4: two runs, one answer
    inp = th.InferInput("image", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    res = c.infer("digits4", [inp], headers={"Authorization": f"Bearer {KEY}"})
    assert np.array_equal(res.as_numpy("logits"), mb.digits_ref_rows(env.ref4, x))


def test_concurrent_requests_are_batched_and_each_gets_its_rows(env):
    X = env.X[:12]
    h = {"Authorization": f"Bearer {KEY}"}

    def one(i):
        body = {"inputs": [{"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32",
                            "data": X[i].ravel().tolist()}]}  # fmt: skip
        for _ in range(50):  # the queue holds 2: retry on 429 as a client would
            r = httpx.post(f"{env.url4}/v2/models/digits4/infer", json=body, headers=h, timeout=30)
            if r.status_code != 429:
                return r
            time.sleep(float(r.headers["Retry-After"]) / 10)
        return r

    with cf.ThreadPoolExecutor(6) as pool:
        rs = list(pool.map(one, range(12)))
    want = mb.digits_ref_rows(env.ref4, X)
    for i, r in enumerate(rs):
        assert r.status_code == 200, r.text
        y = np.asarray(r.json()["outputs"][0]["data"], np.float32).reshape(1, 10)
        assert np.array_equal(y[0], want[i])
    text = httpx.get(f"{env.url4}/metrics", headers=h).text
    runs = float(next(ln.split()[-1] for ln in text.splitlines()
                      if ln.startswith("edgepack_batches_total")))  # fmt: skip
    rows = float(next(ln.split()[-1] for ln in text.splitlines()
                      if ln.startswith("edgepack_rows_total")))  # fmt: skip
    assert rows > runs  # some runs held rows of several requests


def _post(url: str, body, **kw) -> httpx.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{url}/v2/models/digits/infer", content=data, timeout=30, **kw)


def _tensor(**over) -> dict:
    t = {"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [0.5] * 64}
    return {"inputs": [{**t, **over}]}


@pytest.mark.parametrize(
    "body, status, code, says",
    [
        ("{not json", 400, "malformed", "not UTF-8 JSON"),
        ('{"inputs": [{"name": "image", "shape": [1,1,8,8], "datatype": "FP32", '
         '"data": [NaN]}]}', 400, "malformed", "NaN is not JSON"),
        ("[]", 400, "malformed", "JSON object"),
        ({"inputs": []}, 400, "invalid_job", "non-empty list"),
        (_tensor(shape=[1, 1, 8, 9], data=[0.5] * 72), 400, "bad_input", "expected"),
        (_tensor(name="img"), 400, "bad_input", "unknown: img"),
        (_tensor(data=[0.5] * 63), 400, "malformed", "needs 64"),
        (_tensor(datatype="BYTES"), 400, "unsupported", "BYTES"),
        (_tensor(datatype="INT8", data=[300] * 64), 400, "bad_input", "out of range for int8"),
        (_tensor(data=[1e39] * 64), 400, "bad_input", "out of range for float32"),
        (_tensor(data=["a"] * 64), 400, "malformed", "not a rectangular array"),
        ({**_tensor(), "outputs": [{"name": "nope"}]}, 400, "bad_input", "does not exist"),
    ],
)  # fmt: skip
def test_bad_requests_get_an_error_and_the_server_keeps_serving(env, body, status, code, says):
    r = _post(env.url1, body)
    assert r.status_code == status, r.text
    assert r.json()["code"] == code and says in r.json()["error"], r.json()
    assert _post(env.url1, _tensor()).status_code == 200


def test_binary_extension_errors(env):
    x = np.zeros((1, 1, 8, 8), np.float32)
    head = json.dumps({"inputs": [{"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32",
                                   "parameters": {"binary_data_size": 256}}]}).encode()  # fmt: skip
    for extra, header_len, says in [
        (x.tobytes()[:100], len(head), "ends 156 bytes short"),
        (x.tobytes() + b"xx", len(head), "2 bytes of binary data"),
        (x.tobytes(), len(head) + 10**6, "does not fit"),
    ]:
        r = _post(env.url1, head + extra, headers={HLEN: str(header_len)})
        assert r.status_code == 400 and says in r.json()["error"], r.text
    r = _post(env.url1, head + x.tobytes(), headers={HLEN: str(len(head))})
    assert r.status_code == 200


def test_unknown_model_and_routes(env):
    r = httpx.post(f"{env.url1}/v2/models/other/infer", json=_tensor())
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    r = httpx.post(f"{env.url1}/v2/models/digits/versions/2/infer", json=_tensor())
    assert r.status_code == 404
    r = httpx.post(f"{env.url1}/v2/models/digits/versions/1/infer", json=_tensor())
    assert r.status_code == 200
    assert httpx.get(f"{env.url1}/v2").json()["extensions"] == ["binary_tensor_data"]
    assert httpx.get(f"{env.url1}/nope").status_code == 404


def test_body_limit(env, tmp_path):
    big = b'{"inputs": [' + b" " * (17 << 20) + b"]}"
    r = _post(env.url1, big)
    assert r.status_code == 413 and r.json()["code"] == "too_large"


def test_api_key(env):
    url = env.url4
    assert httpx.get(f"{url}/health").status_code == 200  # public
    assert httpx.get(f"{url}/v2/health/ready").status_code == 200
    for h in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(f"{url}/v2/models/digits4", headers=h)
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        assert httpx.get(f"{url}/metrics", headers=h).status_code == 401
    r = httpx.get(f"{url}/v2/models/digits4", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    assert KEY not in env.s4.log()


def test_queue_full_is_429_with_retry_after(env):
    h = {"Authorization": f"Bearer {KEY}"}
    body = {"inputs": [{"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32",
                        "data": [0.5] * 64}]}  # fmt: skip
    with cf.ThreadPoolExecutor(8) as pool:
        rs = list(pool.map(lambda _: httpx.post(f"{env.url4}/v2/models/digits4/infer", json=body,
                                                headers=h, timeout=30), range(8)))  # fmt: skip
    codes = sorted(r.status_code for r in rs)
    assert 200 in codes and 429 in codes, codes
    busy = next(r for r in rs if r.status_code == 429)
    assert busy.json()["code"] == "busy" and int(busy.headers["Retry-After"]) >= 1


def test_metrics_are_prometheus_text(env):
    assert _post(env.url1, _tensor()).status_code == 200
    assert _post(env.url1, "{").status_code == 400
    r = httpx.get(f"{env.url1}/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    lines = r.text.splitlines()
    assert "# TYPE edgepack_request_duration_seconds histogram" in lines
    want = 'edgepack_http_requests_total{method="POST",route="/v2/models/{name}/infer",code="200"}'
    ok = [ln for ln in lines if ln.startswith(want)]
    assert ok and float(ok[0].split()[-1]) >= 1
    assert any(ln.startswith('edgepack_errors_total{code="malformed"}') for ln in lines)
    inf = [ln for ln in lines if ln.startswith('edgepack_request_duration_seconds_bucket'
                                               '{front="http",le="+Inf"}')]  # fmt: skip
    assert inf and float(inf[0].split()[-1]) >= 1
    # every sample line is "name{labels} number"
    for ln in lines:
        if not ln.startswith("#"):
            float(ln.rsplit(" ", 1)[1])


def test_openapi_document(env):
    doc = httpx.get(f"{env.url1}/openapi.json").json()
    paths = doc["paths"]
    for p in ("/v2/models/{name}/infer", "/v2/models/{name}", "/health", "/metrics",
              "/v2/health/ready"):  # fmt: skip
        assert p in paths
    body = paths["/v2/models/{name}/infer"]["post"]["requestBody"]["content"]
    assert "inputs" in body["application/json"]["schema"]["properties"]


def test_tls(env, tmp_path):
    import ssl

    tls = mb.make_tls(tmp_path / "tls", clients=())
    ca = ssl.create_default_context(cafile=tls["ca"])
    s, url = _serve(env.b1, env.dir, "htls", "--tls-cert", tls["server_cert"], "--tls-key",
                    tls["server_key"], scheme="https", verify=ca)  # fmt: skip
    r = httpx.post(f"{url}/v2/models/digits_cnn/infer", json=_tensor(), verify=ca)
    assert r.status_code == 200
    with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA
        httpx.get(f"{url}/health")
    assert s.terminate(timeout=60) == 0


def test_one_queue_for_mqtt_and_http(env, tmp_path):
    if not mb.have_mosquitto():
        pytest.skip("needs mosquitto (apt-get install mosquitto)")
    from edgepack.client import Client

    broker = mb.Broker(tmp_path / "broker").start()
    s, url = _serve(env.b4, env.dir, "both", "--model", "digits4", broker=broker.url)
    X = env.X[:6]
    client = Client(broker.url)
    try:
        jobs = [client.submit({"image": X[i : i + 1]}, model="digits4") for i in range(3)]
        rs = [httpx.post(f"{url}/v2/models/digits4/infer", json={"inputs": [
            {"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32",
             "data": X[i].ravel().tolist()}]}) for i in range(3, 6)]  # fmt: skip
        want = mb.digits_ref_rows(env.ref4, X)
        for i, j in enumerate(jobs):
            assert np.array_equal(j.result(timeout=30)["logits"][0], want[i])
        for i, r in enumerate(rs, 3):
            assert np.array_equal(np.float32(r.json()["outputs"][0]["data"]), want[i])
        m = httpx.get(f"{url}/metrics").text
        ok = next(ln for ln in m.splitlines()
                  if ln.startswith('edgepack_jobs_total{outcome="ok"}'))  # fmt: skip
        assert float(ok.split()[-1]) == 6  # both fronts count in one service
    finally:
        client.close()
        assert s.terminate(timeout=60) == 0
        broker.stop()


def test_sigterm_answers_requests_in_flight(env, tmp_path):
    # a batching window of 1.5 s: the requests are still queued when SIGTERM arrives
    s, url = _serve(env.b4, env.dir, "drain", "--model", "digits4", "--max-wait-ms", "1500")
    body = {"inputs": [{"name": "image", "shape": [1, 1, 8, 8], "datatype": "FP32",
                        "data": [0.5] * 64}]}  # fmt: skip
    with cf.ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(httpx.post, f"{url}/v2/models/digits4/infer", json=body, timeout=30)
                for _ in range(3)]  # fmt: skip
        time.sleep(0.5)
        s.proc.send_signal(signal.SIGTERM)
        rs = [f.result() for f in futs]
    assert [r.status_code for r in rs] == [200, 200, 200]
    assert s.proc.wait(timeout=60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)
