"""Fair share across tenants (the Virtual Token Counter) on the scheduler alone: whose request is
admitted next, whom preemption takes, and the bound on the service difference between two
tenants that stay backlogged, on scripted arrivals (no model, no timing).

Costs in these tests: prompt tokens × 1, output positions × 2 (the defaults), block size 4.
"""

from __future__ import annotations

import itertools

import pytest
from support.scripted import scripted_request

from pagedserve.workers.engine.request import Request
from pagedserve.workers.kv.checks import assert_no_leaks
from pagedserve.workers.kv.manager import KVCacheManager
from pagedserve.workers.scheduler.fair_share import FairShareConfig, VirtualTokenCounters
from pagedserve.workers.scheduler.scheduler import Scheduler, SchedulerConfig

B = 4  # tokens per block


class Driver:
    """Steps a `Scheduler` as the engine does: scheduled tokens are computed; a sequence that
    reached its last token samples one more and ends at `max_tokens`."""

    def __init__(self, num_blocks=64, max_num_seqs=1, policy="fcfs", fair=True, **weights):
        kv = KVCacheManager(
            num_blocks, B, max_model_len=256, watermark=0.0, enable_prefix_caching=False
        )
        config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            policy=policy,
            fair_share=FairShareConfig(enabled=fair, **weights),
        )
        self.scheduler = Scheduler(config, kv)
        self.started: list[str] = []
        self.finished: list[str] = []
        self.victims: list[str] = []
        self.plans: list[list[str]] = []  # each step's scheduled sequences
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()

    def add(self, request_id, tenant, prompt_len=4, max_tokens=2, priority=0) -> None:
        request = scripted_request(
            request_id, prompt_len, max_tokens, next(self._arrivals), priority, tenant
        )
        self.requests[request_id] = request
        self.scheduler.add(request)

    def step(self) -> None:
        plan = self.scheduler.schedule()
        self.victims += [victim.request_id for victim in plan.preempted]
        self.plans.append([request.request_id for request in plan.scheduled])
        for request, num_new in plan.scheduled.items():
            if request.request_id not in self.started:
                self.started.append(request.request_id)
            request.num_computed_tokens += num_new
            if request.num_computed_tokens == len(request.all_token_ids):
                request.all_token_ids.append(7)
                if request.num_output_tokens == request.params.max_tokens:
                    self.scheduler.finish(request)
                    self.finished.append(request.request_id)

    @property
    def busy(self) -> bool:
        s = self.scheduler
        return bool(s.waiting or s.running or s.swapped)

    def run(self) -> None:
        for _ in range(10_000):
            if not self.busy:
                assert_no_leaks(self.scheduler.kv)
                assert not any(s.sequences for s in self.scheduler.tenants.tenants.values())
                return
            self.step()
        raise AssertionError("the scheduler never drained")

    def counter(self, tenant: str) -> float:
        return self.scheduler.tenants.counter(tenant)

    def backlogged(self, tenant: str) -> bool:
        """The VTC paper's sense: `tenant` has a request waiting in the queue (a tenant whose
        every request runs asks for nothing more, and another may be served past it)."""
        return any(r.tenant == tenant for r in self.scheduler.waiting)


def flood_then_trickle(driver: Driver) -> None:
    """Tenant a floods six requests, then b sends three: all queued before the first step."""
    for i in range(6):
        driver.add(f"a{i}", "a")
    for i in range(3):
        driver.add(f"b{i}", "b")


# ------------------------------------------------------------------- order
def test_the_least_served_tenant_is_admitted_next():
    driver = Driver()
    flood_then_trickle(driver)
    driver.run()
    # Equal counters go to the earlier arrival; then each admission makes its tenant the
    # more served one, so the two alternate while both wait.
    assert driver.started == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "a4", "a5"]
    assert driver.victims == []


def test_fairness_off_is_the_policy_order():
    driver = Driver(fair=False)
    flood_then_trickle(driver)
    driver.run()
    assert driver.started == [f"a{i}" for i in range(6)] + ["b0", "b1", "b2"]


def test_priority_orders_within_a_tenant_and_fairness_across():
    driver = Driver(policy="priority")
    for i, priority in enumerate((3, 1, 2)):
        driver.add(f"a{i}", "a", priority=priority)
    driver.add("b0", "b", priority=9)  # a worse priority than any of a's: still its turn
    driver.add("b1", "b", priority=0)
    driver.run()
    # Equal counters go to the policy's order across tenants too (b1's priority 0 first).
    assert driver.started == ["b1", "a1", "a2", "b0", "a0"]


def test_weights_share_in_proportion():
    # b's weight 2: each of its requests moves its counter half as far, so b gets two
    # admissions for each of a's while both wait.
    driver = Driver(tenant_weights={"b": 2.0})
    for i in range(4):
        driver.add(f"a{i}", "a")
    for i in range(6):
        driver.add(f"b{i}", "b")
    driver.run()
    assert driver.started[:9] == ["a0", "b0", "b1", "a1", "b2", "b3", "a2", "b4", "b5"]


def test_a_tenant_alone_gets_everything_work_conserving():
    fair, plain = Driver(max_num_seqs=3), Driver(max_num_seqs=3, fair=False)
    for driver in (fair, plain):
        for i in range(7):
            driver.add(f"a{i}", "a", prompt_len=5 + i, max_tokens=3)
        steps = 0
        while driver.busy:
            driver.step()
            steps += 1
        driver.run()
        driver.steps = steps
    assert fair.started == plain.started and fair.steps == plain.steps


def test_idle_time_is_not_banked():
    # b was idle while a was served: when b comes back it is lifted to a's counter, so it
    # gets its fair turn, not a monopoly that pays back everything a got alone.
    driver = Driver()
    for i in range(6):
        driver.add(f"a{i}", "a")
    for _ in range(6):  # a0, a1 and a2 done (two steps each), a3 waits
        driver.step()
    served_alone = driver.counter("a")
    assert served_alone > 0 and driver.counter("b") == 0
    for i in range(4):
        driver.add(f"b{i}", "b")
    assert driver.counter("b") == served_alone
    driver.run()
    assert driver.started == ["a0", "a1", "a2", "a3", "b0", "a4", "b1", "a5", "b2", "b3"]


def test_an_idle_system_lifts_to_the_last_tenant_that_left():
    driver = Driver()
    driver.add("a0", "a")
    driver.run()
    assert driver.counter("a") == 4 + 2 * 1  # 4 prompt positions, 1 output position
    driver.add("b0", "b")  # the system is empty: b starts level with a, not below it
    assert driver.counter("b") == driver.counter("a")


# ------------------------------------------------------------------- bound
def service_gaps(fair: bool) -> list[float]:
    """|counter(a) - counter(b)| at each step while both are backlogged, for two tenants with
    different request shapes arriving on a script (a: long outputs, b: long prompts)."""
    driver = Driver(max_num_seqs=2, fair=fair)
    for i in range(12):
        driver.add(f"a{i}", "a", prompt_len=4, max_tokens=12)
    for i in range(4):
        driver.add(f"b{i}", "b", prompt_len=16, max_tokens=2)
    gaps: list[float] = []
    arrivals = iter(range(4, 40))
    while driver.busy:
        if driver.backlogged("a") and driver.backlogged("b"):
            gaps.append(abs(driver.counter("a") - driver.counter("b")))
        driver.step()
        j = next(arrivals, None)
        if j is not None and j % 2 == 0:  # b keeps sending, one request every other step
            driver.add(f"b{j}", "b", prompt_len=16, max_tokens=2)
    driver.run()
    return gaps


def test_the_service_difference_of_backlogged_tenants_stays_bounded():
    # The VTC bound: two tenants backlogged throughout differ by at most what one request
    # can cost in all, twice (admission only picks the less-served, and an admitted request
    # adds at most its whole cost): 2 × max(4 × 1 + 12 × 2, 16 × 1 + 2 × 2) = 56.
    bound = 2 * max(4 + 12 * 2, 16 + 2 * 2)
    gaps = service_gaps(fair=True)
    assert len(gaps) > 30 and max(gaps) <= bound
    # The same arrivals in plain FCFS order: a's flood goes first and the gap grows past it.
    assert max(service_gaps(fair=False)) > bound


# ------------------------------------------------------------------- preemption and charging
def test_the_victim_is_the_most_served_tenants_lowest_ranked():
    # Pool of 6 blocks: a0 and a1 (a's) and b0 run; a has been served more. When b0 needs a
    # block the pool cannot give, the victim is a's latest, a1, not b0 (the latest overall).
    driver = Driver(num_blocks=6, max_num_seqs=3)
    driver.add("a0", "a", prompt_len=8, max_tokens=4)
    driver.add("a1", "a", prompt_len=7, max_tokens=4)
    driver.add("b0", "b", prompt_len=4, max_tokens=4)
    driver.step()  # 2 + 2 + 1 blocks; after sampling b0 has 5 tokens and needs a 2nd block
    assert driver.counter("a") > driver.counter("b") and driver.victims == []
    driver.step()
    assert driver.victims == ["a1"]
    driver.run()


def test_recomputed_positions_are_not_charged_twice():
    driver = Driver(num_blocks=6, max_num_seqs=3)
    driver.add("a0", "a", prompt_len=8, max_tokens=4)
    driver.add("a1", "a", prompt_len=7, max_tokens=4)
    driver.add("b0", "b", prompt_len=4, max_tokens=4)
    driver.run()
    assert driver.victims == ["a1"]  # a1 computed its prompt twice
    service = driver.scheduler.tenants.tenants
    # Each position once: prompts, and every output position but the last (never computed).
    assert (service["a"].prompt_tokens, service["a"].output_tokens) == (8 + 7, 3 + 3)
    assert (service["b"].prompt_tokens, service["b"].output_tokens) == (4, 3)
    assert driver.counter("a") == 15 + 2 * 6 and driver.counter("b") == 4 + 2 * 3


def test_fair_share_config_refuses_bad_weights():
    with pytest.raises(ValueError, match="tenant_weights\\['x'\\]"):
        FairShareConfig(tenant_weights={"x": 0})
    with pytest.raises(ValueError, match="output_weight"):
        FairShareConfig(output_weight=float("nan"))
    assert VirtualTokenCounters(FairShareConfig()).counter("nobody") == 0.0


# ------------------------------------------------------------------- a slot for the less served
def test_a_short_request_of_a_light_tenant_takes_a_slot_from_the_flood():
    # Both slots run a's long requests. b has nothing running and was served no more (it is
    # lifted to a's counter when it arrives): b0 takes the place of a's latest, a1, at the
    # very next step, instead of waiting for one of a's requests to end.
    driver = Driver(max_num_seqs=2)
    driver.add("a0", "a", prompt_len=4, max_tokens=20)
    driver.add("a1", "a", prompt_len=4, max_tokens=20)
    driver.step()
    driver.step()
    driver.add("b0", "b")
    driver.step()
    assert driver.victims == ["a1"] and driver.started[-1] == "b0"
    driver.run()
    assert driver.victims == ["a1"]  # a1 recomputed its KV and finished
    assert set(driver.finished) == {"a0", "a1", "b0"}


def test_the_light_tenant_takes_a_slot_past_the_flood_s_own_queue():
    # a also has a2 waiting, tied with b (b was lifted to a's counter) and first by arrival:
    # a2 may not take a slot from its own tenant, b0 may, and does at the next step.
    driver = Driver(max_num_seqs=2)
    for i in range(3):
        driver.add(f"a{i}", "a", prompt_len=4, max_tokens=20)
    driver.step()
    driver.add("b0", "b")
    driver.step()
    assert driver.victims == ["a1"] and driver.started[-1] == "b0"
    driver.run()
    assert set(driver.finished) == {"a0", "a1", "a2", "b0"}


def test_a_tenant_that_runs_here_waits_for_the_margin():
    # b already runs b0 in one of the two slots: its next request b1 may take a's slot only
    # once a is ahead by more than b1's whole cost (4 + 2 × 2 = 8): not at once.
    driver = Driver(max_num_seqs=2)
    driver.add("a0", "a", prompt_len=4, max_tokens=20)
    driver.add("b0", "b", prompt_len=4, max_tokens=20)
    driver.step()
    driver.add("b1", "b")
    driver.step()
    assert driver.victims == [] and "b1" not in driver.started
    driver.run()
    assert set(driver.finished) == {"a0", "b0", "b1"}


def test_a_tenant_s_only_running_sequence_is_never_taken_for_a_newcomer():
    # With one slot, a newcomer tenant does not take the only sequence another tenant runs
    # (the two would take it from each other in turn); it waits its fair turn.
    driver = Driver(max_num_seqs=1)
    driver.add("a0", "a", prompt_len=4, max_tokens=6)
    driver.step()
    driver.add("b0", "b")
    driver.run()
    assert driver.victims == [] and driver.started == ["a0", "b0"]


def test_fairness_off_makes_the_light_tenant_wait_for_a_slot():
    driver = Driver(max_num_seqs=2, fair=False)
    driver.add("a0", "a", prompt_len=4, max_tokens=20)
    driver.add("a1", "a", prompt_len=4, max_tokens=20)
    driver.add("b0", "b")
    driver.run()
    assert driver.victims == [] and driver.started == ["a0", "a1", "b0"]


def test_two_busy_tenants_do_not_trade_places():
    # Equal floods: the margin (one request's whole cost) keeps either from preempting the
    # other back and forth; slots are shared as they free.
    driver = Driver(max_num_seqs=4)
    for i in range(6):
        driver.add(f"a{i}", "a", prompt_len=4, max_tokens=12)
        driver.add(f"b{i}", "b", prompt_len=4, max_tokens=12)
    driver.run()
    assert driver.victims == []
    assert driver.counter("a") == driver.counter("b")


# ------------------------------------------------------------------- newcomer steps
def flood_running(driver: Driver, num: int = 3) -> None:
    """a runs `num` long requests, their prompts computed."""
    for i in range(num):
        driver.add(f"a{i}", "a", prompt_len=4, max_tokens=20)
    driver.step()


def flood_then_newcomer(**driver_args) -> Driver:
    """a's flood running (`flood_running`), then b0 of tenant b arrives and one step runs."""
    driver = Driver(**driver_args)
    flood_running(driver)
    driver.add("b0", "b")
    driver.step()
    return driver


def test_a_tenant_with_nothing_running_gets_a_step_of_its_own():
    # b arrives beside a's running flood: the next step computes b0's prompt alone (a's
    # decodes wait one step); the one after runs everyone, b0's first decode included.
    driver = flood_then_newcomer(max_num_seqs=4)
    driver.step()
    assert driver.plans[1:] == [["b0"], ["a0", "a1", "a2", "b0"]]
    assert driver.scheduler.counters.newcomer_steps == 1
    driver.run()
    assert driver.victims == [] and len(driver.finished) == 4


def test_newcomer_steps_never_come_two_in_a_row():
    # b0 has its step; c0, arrived meanwhile, waits for an ordinary one (a decodes in it),
    # then b1 (b runs b0 now) is admitted in an ordinary step too.
    driver = flood_then_newcomer(max_num_seqs=6)
    driver.add("c0", "c")
    driver.add("b1", "b")
    driver.step()
    assert driver.plans[1] == ["b0"]
    assert set(driver.plans[2]) == {"a0", "a1", "a2", "b0", "c0", "b1"}
    assert driver.scheduler.counters.newcomer_steps == 1
    driver.run()


def test_a_newcomer_takes_a_slot_in_its_step_when_every_slot_runs():
    # Every slot runs a's: b0's step claims one (a's latest yields, as without newcomer steps).
    driver = flood_then_newcomer(max_num_seqs=3)
    assert driver.plans[1] == ["b0"] and driver.victims == ["a2"]
    driver.run()
    assert set(driver.finished) == {"a0", "a1", "a2", "b0"}


def test_a_tenant_served_more_than_those_running_gets_no_step_of_its_own():
    # b0's long prompt had its newcomer step and ended there (one token); b1 finds b's counter
    # above a's, which has decoded a token a step since: b1 joins a's step.
    driver = Driver(max_num_seqs=4)
    flood_running(driver, num=1)
    driver.add("b0", "b", prompt_len=32, max_tokens=1)
    driver.step()
    assert driver.plans[-1] == ["b0"] and driver.finished == ["b0"]
    driver.step()
    assert driver.counter("b") > driver.counter("a")
    driver.add("b1", "b")
    driver.step()
    assert set(driver.plans[-1]) == {"a0", "b1"}
    assert driver.scheduler.counters.newcomer_steps == 1
    driver.run()


@pytest.mark.parametrize("fair", [True, False], ids=["newcomer-steps-off", "fair-share-off"])
def test_without_newcomer_steps_a_newcomer_s_prompt_joins_the_flood_s_step(fair):
    driver = flood_then_newcomer(max_num_seqs=4, fair=fair, newcomer_steps=not fair)
    assert set(driver.plans[1]) == {"a0", "a1", "a2", "b0"}
    assert driver.scheduler.counters.newcomer_steps == 0
    driver.run()


def test_one_tenant_never_gets_a_newcomer_step():
    driver = Driver(max_num_seqs=4)
    flood_running(driver)
    driver.add("a3", "a")
    driver.step()
    assert set(driver.plans[1]) == {"a0", "a1", "a2", "a3"}
    assert driver.scheduler.counters.newcomer_steps == 0
    driver.run()
