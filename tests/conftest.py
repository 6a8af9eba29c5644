"""Every test that runs requests ends by asserting that nothing leaked (see support/leaks.py)."""

import pytest
from support.leaks import WATCH


@pytest.fixture(scope="session", autouse=True)
def leak_watch():
    with pytest.MonkeyPatch.context() as monkeypatch:
        WATCH.install(monkeypatch)
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


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.rep_call = report
    return report


def pytest_terminal_summary(terminalreporter):
    covered = {kind: len(tests) for kind, tests in WATCH.covered.items() if tests}
    if covered:
        counts = ", ".join(f"{n} checked {kind}s" for kind, n in covered.items())
        terminalreporter.write_line(f"leak checks: {counts} (tests)")
