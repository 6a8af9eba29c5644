"""`pagedserve serve`'s bad starts (issue 45): each mistake is one line, `pagedserve: error:`
naming the flag (or config key) and its value, exit status 2, no traceback, and no Ray
process started, all before Ray would start. Asserted by state (the status, the lines, the
process's children, Ray's session directory), never by time.

Most cases run `pagedserve.cli.main` in this process (cheap); a few run the command as a
user does, in a child process whose Ray directory (RAY_TMPDIR) must stay empty.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid

import pytest
import ray
from support.processes import MARK_ENV, processes_marked

from pagedserve.cli import main
from pagedserve.cluster.serve.preflight import Settings, defaults
from pagedserve.cluster.serve.process_watch import live_children

TINY = ("--model", "tiny-llama")


@pytest.fixture(autouse=True)
def own_signal_handlers():
    """`serve` installs its SIGINT/SIGTERM handlers: give pytest its own back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@pytest.fixture(autouse=True)
def never_serve(monkeypatch):
    """A check that lets a start through fails its test at once instead of serving until
    the suite's timeout; and the Triton check sees no interpreter (scripts/test.sh sets it)."""

    def started(plan, *_):
        raise AssertionError(f"serve started: nothing refused {plan.config}")

    monkeypatch.setattr("pagedserve.cluster.serve.process.serve_until_stopped", started)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def serve_refuses(capsys, *argv: str) -> str:
    """Run `pagedserve serve ARGV` here; assert the refusal's shape; return its one line."""
    children = set(live_children(os.getpid()))
    try:
        status = main(["serve", *argv])
    except SystemExit as exit_:  # argparse's refusal exits
        status = exit_.code
    out, err = capsys.readouterr()
    lines = [line for line in (out + err).splitlines() if line.strip()]
    assert status == 2, (status, lines)
    assert len(lines) == 1 and lines[0].startswith("pagedserve: error: "), lines
    assert "Traceback" not in err
    assert not ray.is_initialized()
    assert set(live_children(os.getpid())) <= children  # nothing started
    return lines[0]


@pytest.fixture
def taken_port():
    """A port something listens on, on every interface."""
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen(1)
        yield held.getsockname()[1]


@pytest.mark.parametrize(
    "argv, named",
    [
        (("--model", "/nonexistent/model"), "--model /nonexistent/model: "),
        ((*TINY, "--kv-cache-bytes", "1000"), "--kv-cache-bytes 1000: holds no KV block"),
        ((*TINY, "--dtype", "fp8"), "--dtype fp8: dtype must be one of"),
        ((*TINY, "--num-workers", "0"), "--num-workers 0: num_workers must be >= 1"),
        ((*TINY, "--block-size", "0"), "--block-size 0: block_size must be >= 1"),
        ((*TINY, "--num-workers", "4096"), "--num-workers 4096: 4096 workers of 1 CPU each"),
        ((*TINY, "--max-model-len", "100000"), "--max-model-len 100000: is longer than"),
        ((*TINY, "--watermark", "1.5"), "--watermark 1.5: watermark must be in [0, 1)"),
        ((*TINY, "--max-num-seqs", "0"), "--max-num-seqs 0: max_num_seqs must be >= 1"),
        ((*TINY, "--attention-backend", "triton"), "--attention-backend triton: 'triton' needs"),
        ((*TINY, "--lease-timeout-s", "1"), "--lease-timeout-s 1.0: lease_timeout_s (1.0) must"),
        ((*TINY, "--worker-cpus", "4095"), "--worker-cpus 4095: "),
        ((*TINY, "--shutdown-grace-s", "-1"), "--shutdown-grace-s -1: must be a finite number"),
        (("--config", "/nonexistent.yaml"), "--config /nonexistent.yaml: "),
        ((*TINY, "--auth-tokens-file", "/nonexistent"), "--auth-tokens-file /nonexistent: "),
        (("--routing-policy", "random"), "argument --routing-policy: invalid choice: 'random'"),
        (("--num-workers", "two"), "argument --num-workers: invalid int value: 'two'"),
        (("--no-such-flag",), "unrecognized arguments: --no-such-flag"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it(capsys, argv, named):
    assert named in serve_refuses(capsys, *argv)


def test_a_model_dir_whose_config_is_not_json(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{not json", encoding="utf-8")
    line = serve_refuses(capsys, "--model", str(tmp_path))
    assert f"--model {tmp_path}: its config.json does not load" in line


@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port"])
def test_a_port_already_taken(capsys, taken_port, flag):
    line = serve_refuses(capsys, *TINY, flag, str(taken_port))
    assert f"{flag} {taken_port}: already in use" in line


def test_the_same_port_twice(capsys):
    line = serve_refuses(capsys, *TINY, "--http-port", "18999", "--grpc-port", "18999")
    assert "--grpc-port 18999: is the HTTP port too" in line


def test_cuda_where_there_is_none(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    line = serve_refuses(capsys, *TINY, "--device", "cuda")
    assert "--device cuda: no CUDA device is available here" in line


def test_a_setting_from_the_config_file_is_named_as_written_there(capsys, tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("engine:\n  model: tiny-llama\n  block_size: 0\n", encoding="utf-8")
    line = serve_refuses(capsys, "--config", str(path))
    assert f"{path}: engine.block_size 0: block_size must be >= 1" in line
    path.write_text("- a list\n", encoding="utf-8")
    assert "expected a mapping" in serve_refuses(capsys, "--config", str(path))
    path.write_text("engine: {model: [unclosed\n", encoding="utf-8")
    assert f"--config {path}: " in serve_refuses(capsys, "--config", str(path))


def test_a_section_s_field_is_named_in_its_section_and_a_misplaced_one_says_where(capsys, tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("scaling:\n  num_workers: 0\nengine: {model: tiny-llama}\n", encoding="utf-8")
    line = serve_refuses(capsys, "--config", str(path))
    assert f"{path}: scaling.num_workers 0: num_workers must be >= 1" in line
    path.write_text("scaling:\n  enable_pull: false\n", encoding="utf-8")
    line = serve_refuses(capsys, "--config", str(path), "--model", "tiny-llama")
    assert f"{path}: unknown scaling keys: enable_pull (enable_pull is routing.enable_pull)" in line
    path.write_text("num_workers: 2\nscaling:\n  num_workers: 3\n", encoding="utf-8")
    line = serve_refuses(capsys, "--config", str(path), "--model", "tiny-llama")
    assert "num_workers is given twice: at the top level and as scaling.num_workers" in line


def test_settings_are_named_by_where_they_came_from():
    data = {
        "scaling": {"num_workers": 3},
        "engine": {"kv_cache_bytes": 9, "block_size": 8, "model": "m"},
    }
    settings = Settings(
        data,
        flags=frozenset({"scaling.num_workers"}),
        config_file="c.yaml",
        in_file=frozenset({"engine.block_size"}),
        machine=frozenset({"engine.kv_cache_bytes"}),
        defaults=defaults(),
    )
    assert settings.name("scaling.num_workers") == "--num-workers 3"
    assert settings.name("routing.pull_min_blocks") == "--pull-min-blocks 8 (the default)"
    assert settings.name("engine.block_size") == "c.yaml: engine.block_size 8"
    assert settings.name("engine.kv_cache_bytes") == "--kv-cache-bytes 9 (sized to this machine)"
    assert settings.name("engine.dtype") == "--dtype float32 (the default)"
    assert settings.name("engine.speculative.draft_model").startswith("--speculative-draft-model")
    # A message naming several fields is about the one the user set.
    message = "the pool must start within its bounds: min_workers (1) <= num_workers (0)"
    assert settings.named_in(message) == "scaling.num_workers"
    assert settings.named_in("speculative.num_tokens must be in [1, 16]") == (
        "engine.speculative.num_tokens"
    )


# ------------------------------------------------------- as a user runs it
def run_serve(tmp_path, *argv: str, **env: str) -> subprocess.CompletedProcess:
    """`python -m pagedserve serve ARGV` with its own (empty) Ray directory and a marker in
    its environment, which every process it started would inherit."""
    ray_dir = tmp_path / "ray"
    ray_dir.mkdir(exist_ok=True)
    marker = uuid.uuid4().hex
    environ = {k: v for k, v in os.environ.items() if k != "PAGEDSERVE_DEBUG"}
    environ.update(RAY_TMPDIR=str(ray_dir), **{MARK_ENV: marker}, **env)
    result = subprocess.run(
        [sys.executable, "-m", "pagedserve", "serve", *argv],
        capture_output=True,
        text=True,
        env=environ,
        timeout=300,
    )
    assert list(ray_dir.iterdir()) == [], "a Ray session was started"
    assert processes_marked(marker) == [], "a process it started is still running"
    return result


@pytest.mark.parametrize(
    "argv",
    [("--model", "/nonexistent/model"), ("--num-workers", "two")],
    ids=["checked", "argparse"],
)
def test_the_command_exits_2_with_one_line_and_starts_nothing(tmp_path, argv):
    result = run_serve(tmp_path, *argv)
    assert result.returncode == 2
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("pagedserve: error: "), lines


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback_before_the_line(tmp_path, how):
    argv = ["--model", "/nonexistent/model"] + (["--debug"] if how == "flag" else [])
    result = run_serve(tmp_path, *argv, **({"PAGEDSERVE_DEBUG": "1"} if how == "env" else {}))
    assert result.returncode == 2
    assert "Traceback (most recent call last)" in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("pagedserve: error: --model /nonexistent/model: ")
