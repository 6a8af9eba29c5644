"""Fixtures every test folder shares: the real model, loaded once per session; and the leak
check every test that runs requests ends with (see support/leaks.py)."""

import os
from pathlib import Path

from pagedserve.cluster.serve.ray_startup import allow_slow_startup, exec_only_forks

# First, before anything imports grpc (grpcio reads it on import): see exec_only_forks.
GRPC_FORKS_EXEC_ONLY_IN_TIME = exec_only_forks()

import pytest
import torch
from support.engine import ReferenceModel, load
from support.leaks import WATCH
from support.module_order import order_modules
from support.real_model import SMOLLM2
from support.shared_cluster import SHARED
from support.startups import STARTUPS, StartupCount

# Every local Ray a test starts inherits this process's environment (cluster/serve/ray_startup.py).
allow_slow_startup()
# Ray's token authentication, one mode for every cluster of the run. Unset, the first
# `ray.init()` that starts a local Ray turns it on for this process (`RAY_AUTH_MODE=token`):
# from then on this driver refused the calls of a cluster started before without it (the test
# process's shared cluster, support/shared_cluster.py), and every call to its actors hung or
# died. Test clusters listen on this machine only.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Ray starts its processes 15 nicer than the one that started it; a test's cluster then lost
# the cores to every pytest process beside it (the other xdist process running a CPU-bound
# module, or HF references): beside two busy processes a tiny-llama worker took 2.5 min to
# (re)start instead of seconds, and the tiers test's restart wait timed out in CI. Test
# clusters run at the pytest process's own niceness (scripts/test.sh makes that 10: a test run
# on a shared machine still yields the cores to a server's engine).
os.environ.setdefault("RAY_worker_niceness", "0")


def _threads_per_test_process() -> int | None:
    """Under pytest-xdist, the cores this process may use for torch: the machine's shared
    out among the test processes (at least 1); None when pytest runs alone."""
    processes = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if processes is None:
        return None
    return max(1, len(os.sched_getaffinity(0)) // int(processes))


# Two test processes on two cores, each with torch's default of one OpenMP thread per core,
# oversubscribe the cores, and OpenMP's threads then wait on each other at every parallel
# region: test_spec_decode.py run twice at once took 71 s with 2 threads each, 29 s with 1.
# (Ray workers and the local clusters a test starts inherit the variable; ones whose config
# sets `worker_threads` still get their own.)
if (_threads := _threads_per_test_process()) is not None:
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (float32) and HF's reference copy of it."""
    loaded = load(SMOLLM2)
    return loaded, ReferenceModel(loaded)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's BPE tokenizer alone (no weights loaded)."""
    from pagedserve.workers.model.tokenizer import load_tokenizer

    return load_tokenizer(SMOLLM2)


# ------------------------------------------------------------------ leak checks
@pytest.fixture(scope="session")
def lora_adapters(tmp_path_factory):
    """Three PEFT LoRA adapters over tiny-llama, of ranks 4, 8 and 2 and different targets,
    with HF + PEFT's merged model of each (`support/lora.py`); made once per session."""
    from support.lora import make_test_adapters

    return make_test_adapters(tmp_path_factory.mktemp("loras"))


@pytest.fixture(scope="session", autouse=True)
def leak_watch():
    with pytest.MonkeyPatch.context() as monkeypatch:
        WATCH.install(monkeypatch)
        STARTUPS.install(monkeypatch)
        yield WATCH


@pytest.fixture(scope="module", autouse=True)
def nothing_leaked_at_module_end(leak_watch):
    """Clusters a module's fixtures stop after its last test are checked as they stop."""
    yield
    problems = leak_watch.end_module()
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


@pytest.fixture(autouse=True)
def nothing_leaked(leak_watch, request):
    leak_watch.begin_test(request.node.nodeid)
    yield
    report = getattr(request.node, "rep_call", None)
    problems = leak_watch.end_test(passed=report is not None and report.passed)
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


INTEGRATION = Path(__file__).parent / "integration"


def pytest_collection_modifyitems(items):
    """Integration modules first, those with a Ray of their own before the rest; then the
    longest modules first (support/module_order.py): the order pytest-xdist hands them out."""
    items[:] = order_modules(items)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """The shared local cluster (support/shared_cluster.py) lives across the integration tests
    (scripts/test.sh runs them first): idle, it would take CPU from every later test of this
    process."""
    if INTEGRATION not in item.path.parents:
        SHARED.stop()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.rep_call = report
    return report


# Under pytest-xdist (scripts/test.sh) each worker process has its own WATCH: it sends what
# its checks covered home, and the controller's summary adds them up.
COVERED_FROM_WORKERS: dict[str, set[str]] = {}
STARTUPS_OF_WORKERS = StartupCount()


def pytest_sessionfinish(session):
    SHARED.stop()
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker
        workeroutput["leak_checks_covered"] = {k: sorted(v) for k, v in WATCH.covered.items()}
        workeroutput["startups"] = STARTUPS.as_dict()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's hook, on the controller: a worker finished (only called under xdist)."""
    output = getattr(node, "workeroutput", {})
    for kind, tests in output.get("leak_checks_covered", {}).items():
        COVERED_FROM_WORKERS.setdefault(kind, set()).update(tests)
    if "startups" in output:
        STARTUPS_OF_WORKERS.merge(output["startups"])


def pytest_terminal_summary(terminalreporter):
    kinds = set(WATCH.covered) | set(COVERED_FROM_WORKERS)
    tests = {k: WATCH.covered.get(k, set()) | COVERED_FROM_WORKERS.get(k, set()) for k in kinds}
    covered = {kind: len(tests[kind]) for kind in sorted(kinds) if tests[kind]}
    if covered:
        counts = ", ".join(f"{n} checked {kind}s" for kind, n in covered.items())
        terminalreporter.write_line(f"leak checks: {counts} (tests)")
    startups = StartupCount()
    startups.merge(STARTUPS.as_dict())
    startups.merge(STARTUPS_OF_WORKERS.as_dict())
    if any(startups.counts.values()):
        terminalreporter.write_line(startups.summary())
