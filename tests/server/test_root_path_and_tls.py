"""vLLM's --root-path (FastAPI's root_path) and --ssl-keyfile / --ssl-certfile / --ssl-ca-certs
/ --ssl-cert-reqs (handed to uvicorn) on kiln serve; all were refused as vLLM-only flags."""
import shutil
import ssl
import subprocess

import httpx
import pytest
from fastapi.testclient import TestClient

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.cli.main import build_parser
from kiln.entrypoints.cli.serve import settings_from_args
from kiln.entrypoints.openai.api_server import ServerSettings, build_app
from kiln.entrypoints.openai.server_tls import uvicorn_tls_config

from .fake_engine import FakeEngine
from .uvicorn_thread import uvicorn_in_thread


def _settings(*argv):
    return settings_from_args(build_parser().parse_args(["serve", *argv]))


def test_root_path_serves_under_the_prefix_and_names_it(tmp_path):
    settings = _settings("--root-path", "/api", "--api-key", "k")
    app = build_app(AsyncLLM(FakeEngine(max_model_len=64)), settings)
    with TestClient(app) as client:
        for path in ("/api/v1/models", "/v1/models"):  # a proxy that keeps or strips it
            assert client.get(path, headers={"Authorization": "Bearer k"}).status_code == 200
            assert client.get(path).status_code == 401
        assert client.get("/api/health").status_code == 200  # still open under the prefix
        schema = client.get("/api/openapi.json", headers={"Authorization": "Bearer k"}).json()
        assert schema["servers"] == [{"url": "/api"}]
    with pytest.raises(ValueError, match="--root-path must start with /"):
        _settings("--root-path", "api")


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    """A self-signed certificate for localhost, made by openssl (the venv has no
    cryptography package)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,"
                    "IP:127.0.0.1", "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")],
                   check=True, capture_output=True)
    return d / "key.pem", d / "cert.pem"


def test_tls_flags_serve_https(cert):
    key, crt = cert
    settings = _settings("--ssl-keyfile", str(key), "--ssl-certfile", str(crt))
    app = build_app(AsyncLLM(FakeEngine(max_model_len=64)), settings)
    with uvicorn_in_thread(app, **uvicorn_tls_config(settings)) as port:
        verify = ssl.create_default_context(cafile=str(crt))
        r = httpx.get(f"https://127.0.0.1:{port}/v1/models", verify=verify, timeout=10)
        assert r.status_code == 200 and r.json()["data"]
        with pytest.raises(httpx.HTTPError):  # HTTPS only
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10)
    assert uvicorn_tls_config(ServerSettings()) == {}  # no certificate: plain HTTP


def test_tls_flag_mistakes_are_named_before_the_model_loads(cert, tmp_path):
    key, crt = cert
    with pytest.raises(ValueError, match="--ssl-keyfile needs --ssl-certfile"):
        _settings("--ssl-keyfile", str(key))
    with pytest.raises(ValueError, match="--ssl-certfile / --ssl-keyfile: cannot load"):
        _settings("--ssl-keyfile", str(tmp_path / "missing.pem"), "--ssl-certfile", str(crt))
    with pytest.raises(ValueError, match="--ssl-ca-certs: cannot load"):
        _settings("--ssl-keyfile", str(key), "--ssl-certfile", str(crt),
                  "--ssl-ca-certs", str(tmp_path / "none.pem"))
    with pytest.raises(ValueError, match="--ssl-cert-reqs must be 0"):
        _settings("--ssl-cert-reqs", "7")
