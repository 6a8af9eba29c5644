"""`pagedserve serve` as a user runs it (issue 45), in a child process with tiny-llama:

- Ray's own tools reach the cluster it started, as its start-up line says;
- the Router replica serves HTTP on `--http-port` itself (direct ingress), and a stream nobody
  reads pauses its request there as it does through Serve's proxy; a replica killed is
  replaced on the same port;
- the API's small inconsistencies answer as 400 / INVALID_ARGUMENT through the real proxies;
- SIGTERM stops it once its requests in flight finished, cleanly (no line that reads as a
  failure); SIGINT starts the same stop (one handler for both), and a second signal ends it at
  once;
- the loss of its Ray cluster ends it, with a line saying so and status 1;
- a worker that cannot start (the same error twice) ends the start-up, its cause last.

Each asserts the state it leaves: the exit status, the lines printed, the requests' outputs,
and no process it started still running (every process Ray starts inherits the marker this
test puts in its environment). Durations are never asserted. One server serves the tests that
leave it running, and its stop is the SIGTERM test; the others start their own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import pytest
import requests
from support.api_app import LocalPorts, wait_until
from support.processes import MARK_ENV, processes_marked
from support.unread_stream import open_unread_stream, streamed_text

from pagedserve.cluster.ports import free_port
from pagedserve.proto.pagedserve.v1 import serving_pb2 as pb
from pagedserve.proto.pagedserve.v1 import serving_pb2_grpc
from pagedserve.workers.model.tiny_llama import save_tiny_llama

START_TIMEOUT_S = 600  # a loaded 2-core machine took minutes to start a local Ray
EXIT_TIMEOUT_S = 300  # a failsafe only: what the tests check is the state at the exit
LONG = 1000  # tokens: seconds of decoding on a CPU, while a signal is handled in milliseconds
LONGEST = 2000  # tiny-llama's context is 2048: a stream that outlasts two signals' handling


@dataclass
class Served(LocalPorts):
    """One `pagedserve serve` child process and what it printed."""

    process: subprocess.Popen
    log: Path
    ray_dir: str
    marker: str
    http_port: int
    grpc_port: int

    def lines(self) -> list[str]:
        return [line for line in self.log.read_text(errors="replace").splitlines() if line]

    def wait_for_line(self, pattern: str, timeout_s: float = START_TIMEOUT_S) -> str:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            found = [line for line in self.lines() if re.search(pattern, line)]
            if found:
                return found[0]
            if self.process.poll() is not None:
                pytest.fail(f"exited {self.process.returncode} first:\n" + "\n".join(self.lines()))
            time.sleep(0.2)
        pytest.fail(f"no line matching {pattern!r}:\n" + "\n".join(self.lines()[-30:]))

    def stop(self, signum: int) -> int:
        self.process.send_signal(signum)
        return self.wait_exit()

    def wait_exit(self) -> int:
        return self.process.wait(timeout=EXIT_TIMEOUT_S)

    def after(self, pattern: str) -> list[str]:
        """The lines from the first one matching `pattern` on."""
        lines = self.lines()
        first = next(i for i, line in enumerate(lines) if re.search(pattern, line))
        return lines[first:]

    def assert_nothing_left(self) -> None:
        """No process it started runs on (each inherited the marker), nor does any Ray
        process of its session directory."""
        left = processes_marked(self.marker)
        assert left == [], f"processes it started still run: {left}"


@pytest.fixture
def serve_process(tmp_path) -> Iterator:
    """Start `pagedserve serve` children; each is killed at the end if a test left it."""
    started: list[Served] = []

    def start(*argv: str, serving: bool = True, own_group: bool = False) -> Served:
        served = launch(tmp_path / f"serve-{len(started)}.log", *argv, own_group=own_group)
        started.append(served)
        if serving:
            served.wait_for_line(r"^pagedserve: serving on ")
        return served

    yield start
    for served in started:
        cleanup(served)


def launch(log: Path, *argv: str, own_group: bool = False) -> Served:
    """`own_group`: in a process group of its own (a test may signal the whole group)."""
    # Short: Ray's sockets live under it, and a socket path holds at most 107 characters.
    ray_dir = tempfile.mkdtemp(prefix="ps-", dir="/tmp")
    marker = uuid.uuid4().hex
    http_port, grpc_port = free_port(), free_port()
    command = [
        sys.executable, "-m", "pagedserve", "serve", "--model", "tiny-llama",
        "--num-workers", "1", "--num-kv-blocks", "512",
        "--http-port", str(http_port), "--grpc-port", str(grpc_port), *argv,
    ]  # fmt: skip
    env = {**os.environ, "RAY_TMPDIR": ray_dir, MARK_ENV: marker}
    env.pop("PAGEDSERVE_DEBUG", None)
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=own_group
        )
    return Served(process, log, ray_dir, marker, http_port, grpc_port)


def cleanup(served: Served) -> None:
    if served.process.poll() is None:
        served.process.kill()
        served.process.wait(timeout=60)
    for pid, _ in processes_marked(served.marker):  # a failed test's leftovers: ours only
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    shutil.rmtree(served.ray_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    """The server the tests that leave it running share; the SIGTERM test stops it."""
    # With Ray's dashboard, which `ray list` needs (off by default).
    log = tmp_path_factory.mktemp("served") / "serve.log"
    served = launch(log, "--ray-dashboard", "--shutdown-grace-s", "300")
    try:
        served.wait_for_line(r"^pagedserve: serving on ")
        yield served
    finally:
        cleanup(served)


# ------------------------------------------------------------- Ray's tools
def test_ray_s_own_tools_reach_the_cluster_as_its_start_line_says(served):
    line = served.wait_for_line(r"^pagedserve: Ray cluster at ")
    command = line.split("Ray's tools: ", 1)[1].split()  # RAY_AUTH_MODE=... ray list actors
    env = {**os.environ, **dict(word.split("=", 1) for word in command if "=" in word)}
    ray_cli = str(Path(sys.executable).parent / "ray")
    tools = [word for word in command if "=" not in word]
    assert tools == ["ray", "list", "actors"]
    listed = subprocess.run([ray_cli, *tools[1:]], env=env, capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert "WorkerPoolActor" in listed.stdout and "pagedserve-worker-0" in listed.stdout
    status = subprocess.run([ray_cli, "status"], env=env, capture_output=True, text=True)
    assert status.returncode == 0 and "Active:" in status.stdout, status.stderr[-2000:]


def test_the_local_cluster_s_log_monitor_lists_its_files_every_half_second(served):
    """The server starts its local Ray with `RAY_LOG_MONITOR_MANY_FILES_THRESHOLD=0`
    (`ray_startup.quiet_log_monitor`): the log monitor's idle file listing, 0.1 s apart
    otherwise."""
    served.wait_for_line(r"^pagedserve: serving on ")
    monitors = [
        pid
        for pid, _ in processes_marked(served.marker)
        if "log_monitor.py" in " ".join(psutil.Process(pid).cmdline())
    ]
    assert len(monitors) == 1, monitors
    environ = Path(f"/proc/{monitors[0]}/environ").read_bytes().split(b"\0")
    assert b"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD=0" in environ


def test_ray_s_daemons_run_below_the_engine_at_the_control_plane_s_niceness(served):
    """`place_local_cluster`: the GCS and the raylet, started at this test's niceness (10
    under scripts/test.sh), run at `control_nice` (5) like the rest of the control plane.
    Without the privilege to lower a niceness a GCS above 5 stays, and the raylet keeps its
    own (the actors Ray starts later start 15 above it and could not come back down)."""
    from pagedserve.workers.process.cpu_placement import may_lower_niceness

    served.wait_for_line(r"^pagedserve: serving on ")
    daemons = {
        name: pid
        for pid, name in processes_marked(served.marker)
        if name in ("gcs_server", "raylet")
    }
    assert set(daemons) == {"gcs_server", "raylet"}, daemons
    own, privileged = os.getpriority(os.PRIO_PROCESS, 0), may_lower_niceness()
    expected = {
        "gcs_server": 5 if own <= 5 or privileged else own,
        "raylet": 5 if privileged else own,
    }
    for name, pid in daemons.items():
        assert os.getpriority(os.PRIO_PROCESS, pid) == expected[name], name


def test_serve_metrics_go_out_every_second_and_task_events_stay_for_the_dashboard(served):
    """`ray_startup.quiet_observability`: Serve's metrics every second in every process of the
    cluster; task events, event stats and Ray's own metrics stay on here, as this server runs
    Ray's dashboard."""
    served.wait_for_line(r"^pagedserve: serving on ")
    gcs = [
        pid
        for pid, _ in processes_marked(served.marker)
        if psutil.Process(pid).name() == "gcs_server"
    ]
    assert len(gcs) == 1, gcs
    environ = Path(f"/proc/{gcs[0]}/environ").read_bytes().split(b"\0")
    assert b"RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=1000" in environ
    quiet = (b"RAY_task_events", b"RAY_event_stats", b"RAY_enable_metrics_collection")
    assert not [v for v in environ if v.startswith(quiet)]


# ------------------------------------------------------- HTTP by the replica
def test_the_router_replica_itself_listens_on_the_http_port(served):
    line = served.wait_for_line(r"^pagedserve: serving on ")
    assert f":{served.http_port} (by the Router replica) and gRPC" in line
    pid = listening_pid(served.http_port)
    assert pid is not None
    assert "ServeReplica:pagedserve:Router" in " ".join(psutil.Process(pid).cmdline())
    health = requests.get(f"{served.http_url}/health", timeout=60)
    assert health.status_code == 200, health.text


def test_a_router_replica_that_dies_is_replaced_on_the_same_http_port(served):
    dead = listening_pid(served.http_port)
    os.kill(dead, signal.SIGKILL)
    # Serve starts another replica, which gets the port at once (no quarantine).
    wait_until(
        lambda: listening_pid(served.http_port) not in (None, dead) and healthy(served),
        600,
        "a new Router replica serving on the HTTP port",
    )
    body = {"model": "tiny-llama", "prompt": "a", "max_tokens": 2}
    again = requests.post(f"{served.http_url}/v1/completions", json=body, timeout=120)
    assert again.status_code == 200, again.text


def listening_pid(port: int) -> int | None:
    """The process listening on `port` on this machine, if any."""
    pids = {
        c.pid
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }
    assert len(pids) <= 1, pids
    return next(iter(pids), None)


def healthy(served: Served) -> bool:
    try:
        return requests.get(f"{served.http_url}/health", timeout=60).status_code == 200
    except requests.ConnectionError:  # nothing listening yet
        return False


UNREAD_MAX_TOKENS = 600  # events of ~0.4 KB (5 top logprobs): buffers fill within ~250


def test_an_unread_http_stream_pauses_its_request_and_resumes_unchanged(served):
    body = {
        "model": "tiny-llama", "prompt": [5, 17, 29, 41, 53, 65, 77, 89],
        "max_tokens": UNREAD_MAX_TOKENS, "logprobs": 5, "temperature": 0, "ignore_eos": True,
    }  # fmt: skip
    reference = requests.post(f"{served.http_url}/v1/completions", json=body, timeout=600)
    assert reference.status_code == 200, reference.text
    connection, response = open_unread_stream(served.http_port, {**body, "stream": True}, 600)
    with grpc.insecure_channel(served.grpc_address) as channel:
        stats = serving_pb2_grpc.GenerationStub(channel).GetStats
        paused = wait_until(standing_still(stats), 600, "the unread request standing still")
    assert paused.inflight == 1 and paused.kv.useful_tokens < UNREAD_MAX_TOKENS // 2
    text = streamed_text(response)
    connection.close()
    assert text == reference.json()["choices"][0]["text"]


def standing_still(get_stats):
    """A poll for `wait_until`: the worker's stats once a request is open on it and its steps
    and blocks did not change since the poll before (a request that was not paused would
    finish instead)."""
    previous: list = []

    def poll():
        worker = get_stats(pb.GetStatsRequest(), timeout=60).workers[0]
        snapshot = (worker.inflight, worker.num_steps, worker.kv.used_blocks)
        settled = worker.inflight == 1 and previous == [snapshot]
        previous[:] = [snapshot]
        return worker if settled else None

    return poll


# --------------------------------------------------------------- API nits
def test_the_api_nits_through_the_real_proxies(served):
    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ({**chat, "logprobs": True, "top_logprobs": 1000}, "top_logprobs"),
        ({**chat, "messages": [{"role": "user"}]}, "messages[0].content"),
        ({**chat, "messages": [{"role": "system", "content": None}]}, "messages[0].content"),
        ({**chat, "seed": -1}, "seed"),
        ({**chat, "seed": 2**64}, "seed"),
    ]
    for body, param in cases:
        response = requests.post(f"{served.http_url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param, response.text
    good = requests.post(
        f"{served.http_url}/v1/completions",
        json={"model": "tiny-llama", "prompt": "a", "max_tokens": 2, "seed": 2**64 - 1},
        timeout=120,
    )
    assert good.status_code == 200, good.text
    with grpc.insecure_channel(served.grpc_address) as channel:
        stub = serving_pb2_grpc.GenerationStub(channel)
        for request, field in [
            (pb.GenerateRequest(messages=[pb.ChatMessage(role="user")]), "messages[0].content"),
            (pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(seed=-1)), "seed"),
        ]:
            with pytest.raises(grpc.RpcError) as raised:
                stub.Generate(request, timeout=60)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert raised.value.details().startswith(field), raised.value.details()


# ------------------------------------------------------------------ stops
def test_sigterm_stops_once_the_requests_in_flight_finished(served):
    """The last test of the shared server: its stop, with a stream in flight that finishes
    whole."""
    outcome, reader = streaming(served, LONG)
    assert served.stop(signal.SIGTERM) == 0
    reader.join(EXIT_TIMEOUT_S)
    assert outcome == {"finish_reason": "length", "completion_tokens": LONG}  # whole
    assert_stop_said(served, signal.SIGTERM, grace_s=300, finished=1)


def assert_stop_said(served: Served, signum: int, grace_s: int, finished: int) -> None:
    """From the stop on, the two lines that say so: nothing else but what Ray forwards late at
    INFO (the access log of an earlier request); no process left."""
    name = signal.Signals(signum).name
    said = [line for line in served.after(r"^pagedserve: .*stopping") if " INFO " not in line]
    assert said == [
        f"pagedserve: {name}: stopping; requests in flight get up to {grace_s} s (a second "
        "signal stops at once)",
        f"pagedserve: stopped ({finished} streams in flight finished)",
    ]
    assert not [line for line in served.lines() if "did not answer" in line]
    served.assert_nothing_left()


def stream_completion(served: Served, max_tokens: int, first: threading.Event) -> dict:
    """Stream one greedy completion over HTTP; set `first` at its first chunk. Returns its
    token count (usage) and finish reason."""
    body = {
        "model": "tiny-llama", "prompt": "Paged attention", "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    result: dict = {"finish_reason": None, "completion_tokens": None}
    try:
        with requests.post(
            f"{served.http_url}/v1/completions", json=body, stream=True, timeout=EXIT_TIMEOUT_S
        ) as response:
            for raw in response.iter_lines():
                first.set()
                if not raw.startswith(b"data: ") or raw == b"data: [DONE]":
                    continue
                chunk = json.loads(raw[len(b"data: ") :])
                for choice in chunk.get("choices") or ():
                    result["finish_reason"] = choice.get("finish_reason") or result["finish_reason"]
                if chunk.get("usage"):
                    result["completion_tokens"] = chunk["usage"]["completion_tokens"]
    except requests.RequestException as error:  # the server went away mid-stream
        result["error"] = type(error).__name__
    return result


def streaming(served: Served, max_tokens: int) -> tuple[dict, threading.Thread]:
    """A completion of `max_tokens` streaming from `served` on a thread, once its first chunk
    came: what it will have given (`stream_completion`), and the thread."""
    first, outcome = threading.Event(), {}
    reader = threading.Thread(
        target=lambda: outcome.update(stream_completion(served, max_tokens, first)), daemon=True
    )
    reader.start()
    assert first.wait(EXIT_TIMEOUT_S), "the stream never started"
    return outcome, reader


def test_a_second_signal_stops_at_once(serve_process):
    """SIGINT (Ctrl-C) starts the same graceful stop as SIGTERM (the test above: one handler
    for both), and a second signal of either kind ends it at once."""
    served = serve_process("--shutdown-grace-s", "3600")
    outcome, reader = streaming(served, LONGEST)
    served.process.send_signal(signal.SIGINT)
    served.wait_for_line(r"^pagedserve: SIGINT: stopping")
    # Still in its grace of an hour, for a request of seconds: the second signal ends it.
    assert served.stop(signal.SIGTERM) == 128 + signal.SIGTERM
    assert served.lines()[-1] == "pagedserve: SIGTERM again: stopped at once"
    served.assert_nothing_left()
    reader.join(EXIT_TIMEOUT_S)
    assert outcome.get("completion_tokens") != LONGEST  # cut, not finished


def test_a_lost_ray_cluster_ends_the_server(serve_process):
    served = serve_process()
    gcs = [
        int(stat.parent.name)
        for stat in Path("/proc").glob("[0-9]*/stat")
        if _ppid_and_comm(stat) == (served.process.pid, "gcs_server")
    ]
    assert len(gcs) == 1, gcs
    os.kill(gcs[0], signal.SIGKILL)
    assert served.wait_exit() == 1
    assert served.lines()[-1] == (
        f"pagedserve: the Ray cluster is gone: its gcs_server (pid {gcs[0]}) exited; exiting"
    )
    served.assert_nothing_left()


def test_sigterm_to_the_whole_process_group_ends_without_waiting_for_the_gone_gcs(serve_process):
    """systemd's default stop signals every process of the unit: Ray's GCS and raylet end with
    the server. Its drain's Ray calls would wait a minute for the gone GCS (Ray's reconnect
    timeout) and then fail; the stop sees the cluster go and says so instead."""
    served = serve_process(own_group=True)
    os.killpg(served.process.pid, signal.SIGTERM)
    status = served.wait_exit()
    last = served.lines()[-1]
    # A drain that ran before the GCS ended is a clean stop; either way, one line says which.
    if status == 0:
        assert last.startswith("pagedserve: stopped ("), last
    else:
        assert status == 128 + signal.SIGTERM
        assert re.fullmatch(
            r"pagedserve: SIGTERM: the Ray cluster stopped with it \(its ((gcs_server|raylet) "
            r"\(pid \d+\) exited|GCS at [\d.]+:\d+ refuses connections)\); exiting",
            last,
        ), last
    served.assert_nothing_left()


def _ppid_and_comm(stat: Path) -> tuple[int, str] | None:
    try:
        text = stat.read_text()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2 :].split()[1]), text[
        text.index("(") + 1 : text.rindex(")")
    ]


# --------------------------------------------------------- a failed start
def test_a_worker_that_cannot_start_ends_the_start_with_its_cause_last(serve_process, tmp_path):
    """A checkpoint whose config and tokenizer load (the checks before Ray pass) but whose
    weights are garbage: every worker's constructor fails the same way."""
    model = Path(save_tiny_llama(tmp_path / "broken"))
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    served = serve_process("--model", str(model), serving=False)
    assert served.wait_exit() == 1
    tries = [
        match.group(1)
        for line in served.lines()
        if (match := re.search(r"worker \S+ did not start \((.+)\); stopping it", line))
    ]
    # The same error twice, no more. The pool's lines reach this log through Ray's log
    # forwarding, which may not deliver the second before the exit: the error line is last.
    assert 1 <= len(tries) <= 2 and len(set(tries)) == 1, tries
    assert "header" in tries[0]  # the weights' own error
    assert served.lines()[-1] == f"pagedserve: error: workers of {model} cannot start: {tries[0]}"
    assert not [line for line in served.lines() if line.startswith("pagedserve: serving")]
    served.assert_nothing_left()
