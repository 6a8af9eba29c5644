"""Ray's start-up deadlines: raised where the environment says nothing, kept where it does."""

from pagedserve.cluster.ray_startup import STARTUP_DEADLINES, allow_slow_startup


def test_missing_deadlines_are_raised_to_minutes():
    environ: dict[str, str] = {}
    allow_slow_startup(environ)
    assert environ == STARTUP_DEADLINES
    assert int(environ["RAY_agent_register_timeout_ms"]) >= 120_000  # Ray's default: 30,000
    assert int(environ["RAY_worker_register_timeout_seconds"]) >= 120  # Ray's default: 60
    assert float(environ["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"]) >= 60  # Serve's default: 5


def test_a_deadline_the_environment_sets_is_kept():
    environ = {"RAY_agent_register_timeout_ms": "45000", "PATH": "/bin"}
    allow_slow_startup(environ)
    assert environ["RAY_agent_register_timeout_ms"] == "45000"
    assert environ["RAY_worker_register_timeout_seconds"] == "300"
    assert environ["PATH"] == "/bin"


def test_the_test_session_itself_starts_ray_with_them():
    import os

    for name in STARTUP_DEADLINES:
        assert name in os.environ, name  # set by tests/conftest.py before any ray.init
