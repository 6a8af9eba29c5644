"""Scheduling policies on the scheduler alone: who is admitted first, who is preempted when the
pool runs short, and what bounds a request's wait.

What the policies promise (as vLLM v1's scheduler does):

- FCFS admits in arrival order, and a request is never overtaken by a later arrival: its wait
  is bounded by the requests that arrived before it.
- PRIORITY admits by (priority, arrival). When a running sequence needs a block the pool cannot
  supply, the victim is the lowest-ranked running sequence: the highest priority value, then
  the latest arrival. A waiting request never preempts a running one.
- PRIORITY has no aging: a request waits for as long as requests of a better priority keep
  arriving. That is the only thing its wait is bounded by.

A `Driver` runs the scheduler as the engine does, without a model, on a tiny pool, so every
admission and every victim is exact.
"""

from __future__ import annotations

import itertools

import pytest
from support.scripted import scripted_request

from pagedserve.cluster.config import FailureConfig, FailureMode
from pagedserve.workers.engine.config import EngineConfig
from pagedserve.workers.engine.request import Request, RequestStatus
from pagedserve.workers.kv.checks import assert_no_leaks
from pagedserve.workers.kv.manager import KVCacheManager
from pagedserve.workers.protocol.stats import SchedulerCounters
from pagedserve.workers.scheduler.policy import PreemptionMode
from pagedserve.workers.scheduler.scheduler import Scheduler, SchedulerConfig

B = 4  # tokens per block


class Driver:
    """Steps a `Scheduler` like the engine: each scheduled sequence gets its tokens computed;
    one that reached its last token samples one more, and ends at `max_tokens`."""

    def __init__(
        self,
        policy: str,
        num_blocks: int,
        max_num_seqs: int = 8,
        num_swap_blocks: int = 0,
        **config,
    ) -> None:
        kv = KVCacheManager(
            num_blocks,
            B,
            max_model_len=256,
            watermark=0.0,
            enable_prefix_caching=False,
            num_swap_blocks=num_swap_blocks,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=max_num_seqs, policy=policy, **config), kv
        )
        self.requests: dict[str, Request] = {}
        self.steps: list[list[str]] = []  # per step, the ids scheduled, in plan order
        self.started: list[str] = []  # ids, in the order they were first scheduled
        self.finished: list[str] = []
        self.victims: list[str] = []
        self._arrivals = itertools.count()

    def add(self, request_id: str, prompt_len: int, max_tokens: int, priority: int = 0) -> None:
        request = scripted_request(
            request_id, prompt_len, max_tokens, next(self._arrivals), priority
        )
        self.requests[request_id] = request
        self.scheduler.add(request)

    def step(self) -> None:
        plan = self.scheduler.schedule()
        self.victims += [victim.request_id for victim in plan.preempted]
        self.steps.append([request.request_id for request in plan.scheduled])
        for request, num_new in plan.scheduled.items():
            if request.request_id not in self.started:
                self.started.append(request.request_id)
            request.num_computed_tokens += num_new
            if request.num_computed_tokens == len(request.all_token_ids):  # it samples
                request.all_token_ids.append(7)
                if request.num_output_tokens == request.params.max_tokens:
                    self.scheduler.finish(request)
                    self.finished.append(request.request_id)

    def run(self) -> None:
        """Step until every request finished; then nothing may be left in the pool."""
        for _ in range(10_000):
            if not (self.scheduler.waiting or self.scheduler.running or self.scheduler.swapped):
                assert_no_leaks(self.scheduler.kv)
                return
            self.step()
        raise AssertionError("the scheduler never drained")

    def free_blocks(self) -> int:
        return self.scheduler.kv.pool.num_free_blocks


# ----------------------------------------------------------------- admission
def test_fcfs_admits_in_arrival_order_whatever_the_priority():
    driver = Driver("fcfs", num_blocks=16, max_num_seqs=1)
    for request_id, priority in (("a", 5), ("b", 0), ("c", 1)):
        driver.add(request_id, prompt_len=6, max_tokens=3, priority=priority)
    driver.run()
    assert driver.started == driver.finished == ["a", "b", "c"]
    assert driver.victims == [] and driver.free_blocks() == 16


def test_priority_admits_the_lowest_value_first_and_arrival_breaks_ties():
    driver = Driver("priority", num_blocks=16, max_num_seqs=1)
    for request_id, priority in (("a", 2), ("b", 0), ("c", 1), ("d", 0)):
        driver.add(request_id, prompt_len=6, max_tokens=3, priority=priority)
    driver.run()
    assert driver.started == ["b", "d", "c", "a"]


def test_a_better_priority_arrival_waits_for_a_running_request_it_outranks():
    # vLLM v1 as well: a waiting request never preempts a running one; it is first in line.
    driver = Driver("priority", num_blocks=16, max_num_seqs=1)
    driver.add("low", prompt_len=6, max_tokens=4, priority=1)
    driver.step()
    driver.add("same", prompt_len=6, max_tokens=2, priority=1)
    driver.add("urgent", prompt_len=6, max_tokens=2, priority=0)
    driver.run()
    assert driver.started == ["low", "urgent", "same"] and driver.victims == []


# ---------------------------------------------------------------- preemption
# Block size 4 and a pool of 5 blocks. "x" and "z" have 6-token prompts (2 blocks, room to
# grow to 8 tokens), "y" a 4-token prompt (1 block, full). After the prefill step each has
# sampled one token, the pool is full, and only "y" needs a new block for its next token: the
# victim is the policy's choice, not simply the sequence asking. Each generates 2 tokens, so
# the two left finish in that second step and free the pool.
VICTIM_CASES = [
    # (policy, priorities of x, y, z (arriving in that order), expected victim)
    ("fcfs", (1, 0, 0), "z"),  # the latest arrival, whatever the priorities
    ("priority", (1, 0, 0), "x"),  # the worst priority, though it arrived first
    ("priority", (0, 0, 0), "z"),  # equal priorities: the latest arrival
    ("priority", (0, 0, 1), "z"),
]


def preempting_driver(policy: str, priorities: tuple[int, int, int], **config) -> Driver:
    driver = Driver(policy, num_blocks=5, **config)
    for request_id, prompt_len, priority in zip("xyz", (6, 4, 6), priorities, strict=True):
        driver.add(request_id, prompt_len, max_tokens=2, priority=priority)
    driver.step()  # every prompt computed, one token sampled each: 5 of 5 blocks taken
    assert driver.free_blocks() == 0 and driver.victims == []
    return driver


@pytest.mark.parametrize(("policy", "priorities", "victim"), VICTIM_CASES)
def test_the_victim_is_the_lowest_ranked_running_sequence(policy, priorities, victim):
    driver = preempting_driver(policy, priorities)
    driver.step()
    assert driver.victims == [victim] and "y" in driver.steps[-1]  # y got the block
    assert driver.requests[victim].status is RequestStatus.WAITING  # recompute: KV dropped
    assert not driver.scheduler.kv.has_request(victim)
    driver.run()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_victim_comes_back_before_later_arrivals_and_is_counted(mode):
    driver = preempting_driver("priority", (1, 0, 0), preemption_mode=mode, num_swap_blocks=4)
    driver.add("late", prompt_len=6, max_tokens=2, priority=1)  # as bad as "x", but later
    driver.step()
    status = RequestStatus.SWAPPED if mode == "swap" else RequestStatus.WAITING
    assert driver.victims == ["x"] and driver.requests["x"].status is status
    driver.step()  # room again: "x" is back first, then "late" is admitted
    if mode == "swap":  # swapped in (its first decode is the next step's), then "late"
        assert driver.steps[2] == ["late"] and driver.requests["x"].status is RequestStatus.RUNNING
        assert driver.scheduler.kv.has_request("x") and not driver.scheduler.kv.is_swapped_out("x")
    else:  # readmitted from the waiting queue ahead of "late"
        assert driver.steps[2] == ["x", "late"]
    driver.run()
    assert driver.finished == ["y", "z", "x", "late"] and driver.free_blocks() == 5
    prompts = 6 + 4 + 6 + 6  # each prompt once, "late" included
    if mode == "swap":  # x's KV came back from the swap area: nothing computed again
        expected = SchedulerCounters(prefill_tokens=prompts, swapped_out=1, swapped_in=1)
    else:  # x's whole sequence (prompt and its one token) computed again
        expected = SchedulerCounters(prefill_tokens=prompts + 6 + 1, recomputed=1)
    assert driver.scheduler.counters == expected


# ---------------------------------------------------------------- starvation
def test_fcfs_never_lets_a_later_arrival_overtake():
    # One sequence at a time and a new arrival every step: each request still starts right
    # after the ones that arrived before it, however many arrive after it.
    driver = Driver("fcfs", num_blocks=16, max_num_seqs=1)
    arrivals = [f"r{i}" for i in range(12)]
    for request_id in arrivals[:3]:
        driver.add(request_id, prompt_len=6, max_tokens=3)
    for request_id in arrivals[3:]:
        driver.step()
        driver.add(request_id, prompt_len=6, max_tokens=3, priority=-1)  # priority is moot
    driver.run()
    assert driver.started == driver.finished == arrivals


def test_priority_has_no_aging_a_low_request_waits_while_better_ones_keep_arriving():
    driver = Driver("priority", num_blocks=16, max_num_seqs=1)
    driver.add("low", prompt_len=6, max_tokens=2, priority=1)
    driver.add("high-0", prompt_len=6, max_tokens=2, priority=0)
    for i in range(1, 10):  # a better request arrives before each one ends
        driver.step()
        assert "low" not in driver.started
        driver.add(f"high-{i}", prompt_len=6, max_tokens=2, priority=0)
    driver.run()
    # It ran the moment no better request was waiting, and not one step before.
    assert driver.started == [f"high-{i}" for i in range(10)] + ["low"]


def test_modes_are_enums_from_their_names_and_a_bad_name_is_named():
    config = EngineConfig(model="tiny-llama", preemption_mode="swap")
    assert config.preemption_mode is PreemptionMode.SWAP and config.preemption_mode == "swap"
    assert FailureConfig(on_worker_failure="fail").on_worker_failure is FailureMode.FAIL
    with pytest.raises(ValueError, match="preemption_mode must be one of .* got 'drop'"):
        EngineConfig(model="tiny-llama", preemption_mode="drop")
    with pytest.raises(ValueError, match="on_worker_failure must be one of .* got 'retry'"):
        FailureConfig(on_worker_failure="retry")
