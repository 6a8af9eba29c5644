"""Fault injection lives in a subclass the pool creates only when asked: the production worker
has no fault methods, and the faults' counters are used up one call at a time."""

from __future__ import annotations

import dataclasses

import pytest
from support.cluster import cluster_config

from pagedserve.cluster.pool.spec import WorkerSpec, worker_class
from pagedserve.workers.worker.actor import Worker
from pagedserve.workers.worker.fault_injection import FaultInjectingWorker, StepFaults


def test_the_production_worker_has_no_fault_methods():
    assert [name for name in dir(Worker) if name.startswith("chaos_")] == []
    assert {name for name in dir(FaultInjectingWorker) if name.startswith("chaos_")} == {
        "chaos_stall",
        "chaos_refuse_next",
        "chaos_fail_next_kv_fetch",
        "chaos_drop_next_event_batch",
    }


def test_the_pool_creates_the_fault_injecting_worker_only_when_configured():
    config = cluster_config("t-faults")
    assert config.failure.fault_injection  # test clusters take faults
    failure = dataclasses.replace(config.failure, fault_injection=False)
    production = dataclasses.replace(config, failure=failure)
    assert worker_class(WorkerSpec.of(production)) is Worker
    assert worker_class(WorkerSpec.of(config)) is FaultInjectingWorker
    assert WorkerSpec.of(production).fingerprint != WorkerSpec.of(config).fingerprint


def test_counted_faults_are_used_up_one_call_at_a_time():
    faults = StepFaults()
    assert not faults.take_refusal() and not faults.take_kv_fetch_failure()
    faults.refuse_next, faults.fail_kv_fetches = 2, 1
    assert [faults.take_refusal() for _ in range(3)] == [True, True, False]
    assert [faults.take_kv_fetch_failure() for _ in range(2)] == [True, False]
    faults.drop_next_batch = True
    assert [faults.take_batch_drop() for _ in range(2)] == [True, False]


def test_a_delayed_stall_holds_the_step_after_its_steps_until_released():
    faults = StepFaults()
    faults.stall(True, after_steps=2)
    for _ in range(2):  # two steps run
        assert not faults.stalled
        faults.before_step()
        faults.after_step()
    assert faults.stalled  # the third waits
    faults.stall(False)
    assert not faults.stalled
    faults.before_step()  # released: returns at once
    with pytest.raises(ValueError, match="after_steps must be >= 0"):
        faults.stall(True, after_steps=-1)
