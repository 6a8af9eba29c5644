"""Whatever the scheduler decides, the KV each sequence uses is its own: on random arrivals,
tenants, priorities, n > 1 branches, paused readers and aborts, in a small pool, every position
a scheduled sequence reads as computed holds the KV of its own tokens, and every victim leaves
(swapped out or moved) with its own KV. Each preemption mode, both policies, fair share on and
off.

An oracle stands for the pool's content: for each (block, slot), the tokens whose KV it holds
(the KV of position p is a function of tokens[0..p]). Each step applies the plan's copies in the
order `Engine._move_blocks` runs them (swap-ins, then victims' swap-outs and hand-offs, then
copy-on-write), then the forward: every scheduled sequence writes its new positions and reads
its computed ones (a prefix hit on a block this same forward fills reads it after the write,
as each layer stores the step's K/V before it attends).
"""

from __future__ import annotations

import itertools
import random

import pytest

from pagedserve.workers.engine.request import Request
from pagedserve.workers.kv.manager import KVCacheManager
from pagedserve.workers.protocol.sampling import SamplingParams
from pagedserve.workers.scheduler.fair_share import FairShareConfig
from pagedserve.workers.scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

B = 4  # tokens per block
NUM_REQUESTS = 40

Slot = tuple[int, int]  # (block id, offset)


class KVOracle:
    """What each device block slot and swap slot holds, as the engine would leave it."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.device: dict[Slot, tuple[int, ...]] = {}
        self.swap: dict[Slot, tuple[int, ...] | None] = {}

    def run_step(self, plan: SchedulerOutput) -> list[str]:
        """Apply `plan` (copies, then the forward); the problems found, as sentences."""
        problems = []
        for slot, block in plan.swap_in:
            self._copy(self.swap, slot, self.device, block)
        for block, slot in plan.swap_out:
            self._copy(self.device, block, self.swap, slot)
        for victim, block_ids in plan.moved:  # packed for the peer here
            for position in range(victim.num_computed_tokens):
                if (held := _wrong(self.device, block_ids, victim, position)) is not None:
                    problems.append(f"moved {victim.request_id} takes {held} at {position}")
        for src, dst in plan.all_copies():
            self._copy(self.device, src, self.device, dst)
        written = {}
        for request, num_new in plan.scheduled.items():
            table = self.kv.get_block_ids(request.request_id)
            start = request.num_computed_tokens
            for position in range(start, start + num_new):
                written[_slot(table, position)] = _kv_of(request, position)
        seen = {**self.device, **written}
        for request in plan.scheduled:
            table = self.kv.get_block_ids(request.request_id)
            for position in range(request.num_computed_tokens):
                if (held := _wrong(seen, table, request, position)) is not None:
                    problems.append(f"{request.request_id} reads {held} at {position}")
        self.device.update(written)
        return problems

    @staticmethod
    def _copy(source: dict, src: int, target: dict, dst: int) -> None:
        for offset in range(B):
            target[(dst, offset)] = source.get((src, offset))


def _slot(table: list[int], position: int) -> Slot:
    return table[position // B], position % B


def _kv_of(request: Request, position: int) -> tuple[int, ...]:
    """What the KV of `position` is a function of: the tokens up to it."""
    return tuple(request.all_token_ids[: position + 1])


def _wrong(content: dict, table: list[int], request: Request, position: int) -> str | None:
    """None when `content` holds `request`'s own KV at `position`, else what it holds."""
    held = content.get(_slot(table, position))
    if held == _kv_of(request, position):
        return None
    return "nothing" if held is None else f"the KV of another {len(held)} tokens"


def run_random_load(seed: int, mode: str, policy: str, fair: bool) -> list[str]:
    """One random run to its end; the oracle's problems (empty: every read was right)."""
    rng = random.Random(seed)
    kv = KVCacheManager(
        rng.choice([10, 12, 16, 24]), B, max_model_len=64, watermark=0.0,
        num_swap_blocks=12 if mode == "swap" else 0,
    )  # fmt: skip
    config = SchedulerConfig(
        max_num_seqs=rng.choice([2, 3, 4, 6]),
        max_num_batched_tokens=rng.choice([6, 8, 16, 64]),
        policy=policy,
        preemption_mode=mode,
        fair_share=FairShareConfig(enabled=fair),
    )
    scheduler, oracle = Scheduler(config, kv), KVOracle(kv)
    load = RandomLoad(rng, scheduler)
    while load.num_added < NUM_REQUESTS or load.busy:
        load.arrive_pause_abort()
        plan = scheduler.schedule()
        if problems := oracle.run_step(plan):
            return problems
        load.compute(plan)
    return []


class RandomLoad:
    """Requests over two shared prefixes, from three tenants (each its own cache scope), some
    with branches forked after their prompt; readers that pause and come back; aborts. Steps
    as the engine does: a sequence that computed its last token samples one more (a function
    of its tokens, so that branches stay alike) and ends at `max_tokens`."""

    def __init__(self, rng: random.Random, scheduler: Scheduler) -> None:
        self.rng, self.scheduler = rng, scheduler
        self.prefixes = [[rng.randrange(1, 4) for _ in range(12)] for _ in range(2)]
        self.groups: dict[str, list[Request]] = {}
        self.arrivals = itertools.count()
        self.num_added = 0

    @property
    def busy(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self.scheduler.swapped)

    def arrive_pause_abort(self) -> None:
        rng = self.rng
        while self.num_added < NUM_REQUESTS and rng.random() < 0.4:
            self._add(f"r{self.num_added}")
            self.num_added += 1
        for group in self.groups.values():
            if rng.random() < 0.05:  # its reader stopped, or came back
                for request in group:
                    request.paused = not request.paused
        live = self.scheduler.running + self.scheduler.waiting
        if live and rng.random() < 0.03:
            for request in self.groups[rng.choice(live).group_id]:
                request.pending_branches = []
                if request.status.value != "finished":
                    self.scheduler.finish(request)

    def _add(self, group_id: str) -> None:
        rng = self.rng
        tenant = rng.choice("abc")
        prompt = rng.choice(self.prefixes)[: rng.choice([4, 8, 12])]
        prompt += [rng.randrange(1, 4) for _ in range(rng.randrange(0, 6))]
        n = rng.choice([1, 1, 2, 3])
        branches = [
            Request(
                request_id=f"{group_id}#{j}",
                group_id=group_id,
                branch_index=j,
                prompt_len=len(prompt),
                all_token_ids=list(prompt),
                params=SamplingParams(max_tokens=rng.randrange(1, 10), ignore_eos=True),
                cache_extra_keys=(tenant,),
                priority=rng.randrange(3),
                tenant=tenant,
                arrival_order=next(self.arrivals),
                movable=True,
            )  # fmt: skip
            for j in range(n)
        ]
        self.groups[group_id] = branches
        if n > 1 and rng.random() < 0.5:  # forked once the prompt is computed
            branches[0].pending_branches = branches[1:]
            self.scheduler.add(branches[0])
        else:
            for branch in branches:
                self.scheduler.add(branch)

    def compute(self, plan: SchedulerOutput) -> None:
        for request, num_new in plan.scheduled.items():
            request.num_computed_tokens += num_new
            if request.num_computed_tokens < len(request.all_token_ids):
                continue
            token = hash(tuple(request.all_token_ids)) % 3 + 1
            forked, request.pending_branches = request.pending_branches, []
            for branch in forked:
                self.scheduler.kv.fork(request.request_id, branch.request_id)
                branch.all_token_ids = list(request.all_token_ids)
                branch.num_computed_tokens = request.num_computed_tokens
                self.scheduler.add_running(branch)
            for sequence in [request, *forked]:
                sequence.all_token_ids.append(token)
                if sequence.num_output_tokens >= sequence.params.max_tokens:
                    self.scheduler.finish(sequence)


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "unfair"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("mode", ["recompute", "swap", "move"])
def test_every_sequence_reads_and_takes_away_only_its_own_kv(mode, policy, fair):
    problems = {seed: p for seed in range(40) if (p := run_random_load(seed, mode, policy, fair))}
    assert not problems, problems
