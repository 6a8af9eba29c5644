"""Ray's start-up deadlines: raised where the environment says nothing, kept where it does;
and the node-registration wait that Ray fixes at 30 s, made patient."""

import inspect

import pytest
import ray._private.node
import ray._private.services

from pagedserve.cluster.ray_startup import (
    NODE_REGISTRATION_DEADLINE_S,
    STARTUP_DEADLINES,
    allow_slow_startup,
    patient,
)


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


def test_the_node_start_up_polls_the_function_made_patient():
    """Ray's node start-up waits for registration by polling `services.get_node`; if a Ray
    upgrade stops doing so, the patient wait below no longer applies and this fails."""
    source = inspect.getsource(ray._private.node.Node.__init__)
    assert "ray._private.services.get_node(" in source
    assert getattr(ray._private.services.get_node, "__pagedserve_patient__", False)
    assert NODE_REGISTRATION_DEADLINE_S >= 120


def test_patient_get_node_retries_until_the_node_registers():
    answers = iter([RuntimeError("not yet"), RuntimeError("not yet"), {"node_id": "n1"}])

    def get_node(gcs_address, node_id):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert patient(get_node, deadline_s=60, poll_s=0)("gcs", "n1") == {"node_id": "n1"}


def test_patient_get_node_gives_up_at_its_deadline_with_the_last_error():
    calls = []

    def get_node(gcs_address, node_id):
        calls.append(1)
        raise RuntimeError("node n1 never registered")

    with pytest.raises(RuntimeError, match="never registered"):
        patient(get_node, deadline_s=0, poll_s=0)("gcs", "n1")
    assert calls == [1]


def test_other_errors_are_not_retried():
    def get_node(gcs_address, node_id):
        raise ValueError("bad address")

    with pytest.raises(ValueError):
        patient(get_node, deadline_s=60, poll_s=0)("gcs", "n1")
