"""Runs Python worker processes with hard time limits and guaranteed cleanup.

Every worker starts in its own session (process group), so a timeout or a failed sibling kills the
worker and anything it spawned. Nothing here measures time: the limits only turn a hang into a
clear test failure.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HELPERS = Path(__file__).resolve().parent
REPO = HELPERS.parents[1]


@dataclass
class Result:
    """What a finished (or killed) worker left behind."""

    args: list[str]
    returncode: int
    output: str
    timed_out: bool = False

    def tail(self, chars: int = 4000) -> str:
        return self.output[-chars:]

    def check(self) -> "Result":
        """Raises AssertionError with the worker's output unless it exited 0 on its own."""
        if self.timed_out:
            raise AssertionError(
                f"worker {self.args} hit its time limit and was killed:\n{self.tail()}"
            )
        if self.returncode < 0:
            name = signal.Signals(-self.returncode).name
            raise AssertionError(f"worker {self.args} died from {name}:\n{self.tail()}")
        if self.returncode != 0:
            raise AssertionError(f"worker {self.args} exited {self.returncode}:\n{self.tail()}")
        return self


def free_ports(count: int) -> list[int]:
    """Distinct TCP ports on 127.0.0.1 that were free a moment ago (all held open while picking)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def worker_env(**extra: str) -> dict[str, str]:
    """The environment for a worker: quiet TF, no GPU, no inherited TF_CONFIG, repo importable."""
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "PYTEST_CURRENT_TEST")}
    env.update(
        TF_CPP_MIN_LOG_LEVEL="2",
        CUDA_VISIBLE_DEVICES="",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(REPO)])),
    )
    env.update(extra)
    return env


def tf_config(ports: list[int], index: int) -> str:
    """TF_CONFIG for worker `index` of a loopback cluster with one worker per port."""
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})


def start(
    script: str, *args: str, env: dict[str, str] | None = None, log: Path | None = None
) -> subprocess.Popen:
    """Starts `python tests/helpers/<script> args...` in a new session, output to `log`."""
    cmd = [sys.executable, str(HELPERS / script), *map(str, args)]
    out = open(log, "w") if log is not None else subprocess.DEVNULL
    try:
        return subprocess.Popen(
            cmd,
            env=env or worker_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=str(REPO),
            start_new_session=True,
        )
    finally:
        if log is not None:
            out.close()


def kill(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Sends `sig` to the worker's whole process group (if still running) and reaps it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
    proc.wait()


def wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout: float) -> list[Result]:
    """Waits for all workers; kills all of them on timeout or as soon as one fails."""
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break  # a sibling died: the others would block in a collective until the limit
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.2)
    finally:
        running = [p.poll() is None for p in procs]
        for p in procs:
            kill(p)
    return [
        Result(
            p.args, p.returncode, Path(log).read_text(errors="replace"), timed_out and was_running
        )
        for p, log, was_running in zip(procs, logs, running)
    ]


def run(
    script: str, *args: str, tmp: Path, timeout: float, env: dict[str, str] | None = None
) -> Result:
    """Runs one worker to completion (or kills it at `timeout`) and returns its Result."""
    log = tmp / f"{Path(script).stem}.{time.monotonic_ns()}.log"
    return wait_all([start(script, *args, env=env, log=log)], [log], timeout)[0]


def wait_for_file(path: Path, proc: subprocess.Popen, timeout: float) -> bool:
    """Waits until `path` exists; False if the worker exited first or the limit passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return True
        if proc.poll() is not None:
            return path.exists()
        time.sleep(0.05)
    return False
