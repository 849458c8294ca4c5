"""`kiln serve` start-up: a port in use is reported before the model loads (exit 2, one line)."""
import socket
import subprocess
import sys


def test_a_port_in_use_is_reported_before_the_model_loads(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # A model that does not exist: loading it first would fail with another message.
        result = subprocess.run(
            [sys.executable, "-m", "kiln.entrypoints.cli.main", "serve",
             str(tmp_path / "no-such-model"), "--port", str(port)],
            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "--port" in result.stderr
    assert "no-such-model" not in result.stderr
