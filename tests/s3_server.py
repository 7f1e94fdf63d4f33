"""An S3-compatible endpoint for the tests: moto's server on 127.0.0.1 (a free port), one bucket per
call of `fresh_url`. `why_missing()` is the one line a test skips with when moto is not installed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Callable


@dataclass
class S3Server:
    endpoint: str
    stop: Callable[[], None]

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="test", aws_secret_access_key="test")

    def fresh_url(self) -> str:
        """s3://<a new bucket>/buf"""
        name = "rs-" + uuid.uuid4().hex[:16]
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}/buf"


def why_missing() -> str | None:
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError as exc:
        return f"no S3 endpoint: moto's server is not installed ({exc.name}; pip install 'moto[server]')"
    return None


def start() -> S3Server:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("moto's S3 server did not start")
            time.sleep(0.1)

    def stop() -> None:
        proc.kill()
        proc.wait()

    return S3Server(f"http://127.0.0.1:{port}", stop)


def environment(server: S3Server) -> dict[str, str]:
    """What a process (a simulated host) needs to reach it."""
    return {"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1"}
