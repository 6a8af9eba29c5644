"""The worker pool gives up starting workers that fail the same way twice in a row (a model
that does not load fails on every worker), and says why in one line."""

from __future__ import annotations

from ray.exceptions import ActorDiedError

from pagedserve.cluster.pool.pool import start_failure_cause
from pagedserve.cluster.pool.types import StartFailures


def test_the_same_cause_twice_in_a_row_is_deterministic():
    failures = StartFailures()
    assert not failures.failed("ValueError: cannot load")
    assert failures.failed("ValueError: cannot load")


def test_different_causes_or_a_success_between_are_not():
    failures = StartFailures()
    assert not failures.failed("node lost")
    assert not failures.failed("not ready within startup_timeout_s (300 s)")
    failures.succeeded()
    assert not failures.failed("not ready within startup_timeout_s (300 s)")


def test_the_cause_is_the_constructor_s_exception_line():
    class CreationFailed(Exception):
        """Ray's error for an actor whose constructor raised."""

    traceback_text = (
        "The actor died because of an error raised in its creation task, "
        "ray::Worker.__init__() (pid=123, ip=10.0.0.1, actor_id=ab12)\n"
        '  File "workers/model/loader.py", line 118, in _load_checkpoint\n'
        "    raise ValueError(...)\n"
        "ValueError: cannot load a causal LM checkpoint from '/m': bad header\n"
    )
    cause = start_failure_cause(CreationFailed(traceback_text), 300)
    assert cause == "ValueError: cannot load a causal LM checkpoint from '/m': bad header"
    assert start_failure_cause(TimeoutError(), 300) == (
        "not ready within startup_timeout_s (300 s)"
    )
    assert start_failure_cause(ActorDiedError(), 300) == str(ActorDiedError()).strip()
