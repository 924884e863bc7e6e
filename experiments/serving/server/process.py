"""`python -m experiments.serve` as a child process on a free loopback port: for benchmarks, scripts and tests."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from experiments.build import REPO_ROOT

ROOT = REPO_ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """Starts the server with Hydra ``overrides`` (its run directory ``out``) and waits until /health answers."""

    def __init__(self, ckpt: str | Path | None, out: str | Path, *overrides: str,
                 startup_timeout_s: float = 120) -> None:
        """``ckpt``: a checkpoint directory to serve (None: the config's model, e.g. with ``backend=sim``)."""
        self.port, self.out, self.terminated = free_port(), Path(out), False
        self.url = f"http://127.0.0.1:{self.port}"
        model = [f"model={ckpt}", "backend.warmup_steps=1"] if ckpt is not None else []
        # the server's output: a file never fills up and blocks the server as a pipe can; closed by stop()
        self.log = tempfile.TemporaryFile()  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "experiments.serve", *model, f"serve.port={self.port}",
             f"hydra.run.dir={out}", *overrides],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.output()}")
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not come up")

    def output(self) -> str:
        """What the server printed so far."""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def get(self, path: str) -> tuple[int, str]:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return r.status, r.read().decode()

    def post(self, path: str, data: bytes) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def metric(self, name: str) -> float:
        """A ``twinserve:<name>`` sample of /metrics."""
        for line in self.get("/metrics")[1].splitlines():
            if line.startswith(f"twinserve:{name}{{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def terminate(self) -> None:
        if self.proc.poll() is None and not self.terminated:
            self.proc.send_signal(signal.SIGTERM)  # once: a second SIGTERM would interrupt the drain
            self.terminated = True

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM (drain, write the run files), then wait; kill after ``timeout``. Returns the exit code."""
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
