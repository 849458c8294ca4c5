"""A TCP port free on this machine: the process group's rendezvous, a server started by a benchmark
or a test."""
import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
