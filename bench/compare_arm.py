"""A running arm of `pagedserve bench compare`: a child process spoken to by `compare_protocol`."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedserve.bench.compare_protocol import QUIT, READY, RUN, ArmRun


class ArmFailed(RuntimeError):
    """An arm exited or printed something the protocol does not allow; its log tail says why."""


@dataclass
class Arm:
    """One engine in its own process, loaded and warmed up, waiting for ``run`` lines."""

    name: str
    command: Sequence[str]
    cwd: str
    env: dict[str, str]
    log_path: str
    runs: list[ArmRun] = field(default_factory=list)
    _process: subprocess.Popen[str] | None = None

    def start(self) -> None:
        log = open(self.log_path, "w", encoding="utf-8")  # noqa: SIM115 - the child keeps it
        self._process = subprocess.Popen(
            list(self.command),
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        log.close()

    def wait_ready(self) -> None:
        line = self._read_line("loading the model and warming up")
        if line != READY:
            raise self._failed(f"said {line[:200]!r} instead of {READY!r}")

    def run_once(self) -> ArmRun:
        process = self._running()
        assert process.stdin is not None
        process.stdin.write(RUN + "\n")
        process.stdin.flush()
        run = ArmRun.from_json(self._read_line("generating"))
        self.runs.append(run)
        return run

    def stop(self) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            return
        try:
            assert process.stdin is not None
            process.stdin.write(QUIT + "\n")
            process.stdin.close()
            process.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            process.kill()
            process.wait()

    def _running(self) -> subprocess.Popen[str]:
        if self._process is None:
            raise ArmFailed(f"{self.name}: not started")
        return self._process

    def _read_line(self, doing: str) -> str:
        process = self._running()
        assert process.stdout is not None
        # Children may print progress of their own on stdout: the protocol's lines are JSON
        # objects or the ready word, so anything else is skipped.
        while True:
            line = process.stdout.readline()
            if not line:
                raise self._failed(f"exited (code {process.wait()}) while {doing}")
            line = line.strip()
            if line == READY or line.startswith("{"):
                return line

    def _failed(self, what: str) -> ArmFailed:
        return ArmFailed(f"{self.name} arm {what}; last lines of {self.log_path}:\n{self._tail()}")

    def _tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"


VLLM_PYTHON_ENV = "PAGEDSERVE_VLLM_PYTHON"


def vllm_python_of(args) -> str | None:
    """vLLM's Python: `--vllm-python`, else `$PAGEDSERVE_VLLM_PYTHON`, else None (no peer arm).

    A path that is not an executable file is refused through the command's own parser."""
    vllm_python = args.vllm_python or os.environ.get(VLLM_PYTHON_ENV) or None
    if vllm_python and not os.access(vllm_python, os.X_OK):
        args._parser.error(f"--vllm-python {vllm_python!r} is not an executable file")
    return vllm_python


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment without PYTHONPATH (the checkout must not leak in), plus extra."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra)
    return env
