"""What `pagedserve bench serve` and `bench ablate` send: seeded prompts, lengths and arrivals.

Workloads (every one but `file` is constructed from `--seed`, not measured traffic; reports say
so):

    uniform        prompt and output lengths uniform in [L·(1−r), L·(1+r)]
    lognormal      lengths lognormal with median L and shape sigma
    seed-lengths   prompt lengths cycling through the seed's five: 37, 91, 128, 201, 511
    shared-prefix  K system prompts × M users: request i is system k + user m's own suffix
    file           one `prompt_len output_len` pair a line (`#` comments), cycled

Prompts are random byte tokens (ids < 256), drawn from a generator seeded by kind and seed; a
cluster keeps its prefix cache between runs, so rerun a workload on a live cluster with another
`--seed` (or restart it) unless warm-cache figures are wanted. Arrivals are a gamma process at
`request_rate` (req/s) with shape `burstiness` — 1 is Poisson, below 1 burstier, above 1 more
regular; an infinite rate sends everything at t = 0. Nothing here starts Ray, so it is
testable alone.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

WORKLOADS = ("uniform", "lognormal", "seed-lengths", "shared-prefix", "file")
SEED_LENGTHS = (37, 91, 128, 201, 511)


@dataclass(frozen=True)
class WorkloadConfig:
    """One workload's shape; `num_requests` None means the workload's natural count."""

    kind: str = "uniform"
    num_requests: int | None = 32
    request_rate: float = math.inf
    burstiness: float = 1.0
    seed: int = 0
    input_len: int = 128
    output_len: int = 16
    range_ratio: float = 0.5  # uniform: ± this fraction of the mean
    sigma: float = 0.5  # lognormal shape
    num_system_prompts: int = 4  # shared-prefix K
    num_users: int = 4  # shared-prefix M
    system_prompt_len: int = 256
    user_len: int = 32
    length_file: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.kind!r}")
        if self.kind == "file" and not self.length_file:
            raise ValueError("the file workload needs --length-file")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.request_rate <= 0 or self.burstiness <= 0:
            raise ValueError("request_rate and burstiness must be > 0")
        for name in ("input_len", "output_len", "num_system_prompts", "num_users"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")

    @property
    def constructed(self) -> bool:
        """True unless the lengths came from a file (they are then whatever the file says)."""
        return self.kind != "file"

    def describe(self) -> str:
        """One line naming the workload and its parameters, for every report."""
        shape = {
            "uniform": f"input {self.input_len}±{self.range_ratio:.0%}, "
            f"output {self.output_len}±{self.range_ratio:.0%}",
            "lognormal": f"input median {self.input_len}, output median {self.output_len}, "
            f"sigma {self.sigma}",
            "seed-lengths": f"inputs {SEED_LENGTHS}, output {self.output_len}",
            "shared-prefix": f"K={self.num_system_prompts} system prompts of "
            f"{self.system_prompt_len} × M={self.num_users} users of {self.user_len}, "
            f"output {self.output_len}",
            "file": f"length pairs from {self.length_file}",
        }[self.kind]
        arrivals = (
            "all at t=0"
            if math.isinf(self.request_rate)
            else f"{'Poisson' if self.burstiness == 1 else f'gamma(k={self.burstiness})'} "
            f"at {self.request_rate} req/s"
        )
        label = "constructed" if self.constructed else "from file"
        return f"{self.kind} ({label}, seed {self.seed}): {shape}; arrivals {arrivals}"


@dataclass(frozen=True)
class PlannedRequest:
    """One request: when it arrives (s after the first), its prompt, how many tokens it wants."""

    index: int
    arrival_s: float
    token_ids: tuple[int, ...]
    max_tokens: int
    group: str | None = None  # shared-prefix: "k/m"


def arrival_times(num: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Gamma-process arrival times, the first at 0 (Poisson when `burstiness` is 1)."""
    if math.isinf(rate):
        return [0.0] * num
    times, now = [], 0.0
    for index in range(num):
        if index:
            now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        times.append(now)
    return times


def read_length_file(path: str) -> list[tuple[int, int]]:
    """`prompt_len output_len` pairs (space or comma separated), skipping blanks and comments."""
    pairs = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            text = line.split("#", 1)[0].replace(",", " ").split()
            if not text:
                continue
            if len(text) != 2 or not all(t.isdigit() and int(t) > 0 for t in text):
                raise ValueError(f"{path}:{number}: expected two positive integers, got {line!r}")
            pairs.append((int(text[0]), int(text[1])))
    if not pairs:
        raise ValueError(f"{path}: no length pairs")
    return pairs


def make_workload(config: WorkloadConfig) -> list[PlannedRequest]:
    """The seeded requests: prompts, output lengths and arrival times, in arrival order.

    Args:
        config: the workload's shape and seed.

    Returns:
        The requests; the same config always gives the same list.
    """
    # Seeded by kind too: two workloads with one seed must not share prompt prefixes (they
    # would hit each other's cached blocks when run against one live cluster).
    rng = random.Random(f"{config.kind}/{config.seed}")
    if config.kind == "shared-prefix":
        prompts, outputs, groups = _shared_prefix(config, rng)
    else:
        lengths = _lengths(config, rng)
        prompts = [tuple(rng.randrange(256) for _ in range(n)) for n, _ in lengths]
        outputs = [m for _, m in lengths]
        groups = [None] * len(lengths)
    times = arrival_times(len(prompts), config.request_rate, config.burstiness, rng)
    return [
        PlannedRequest(i, times[i], prompts[i], outputs[i], groups[i]) for i in range(len(prompts))
    ]


def _lengths(config: WorkloadConfig, rng: random.Random) -> list[tuple[int, int]]:
    if config.kind == "file":
        pairs = read_length_file(config.length_file or "")
        num = config.num_requests or len(pairs)
        return [pairs[i % len(pairs)] for i in range(num)]
    num = config.num_requests or (len(SEED_LENGTHS) if config.kind == "seed-lengths" else 32)
    if config.kind == "seed-lengths":
        return [(SEED_LENGTHS[i % len(SEED_LENGTHS)], config.output_len) for i in range(num)]
    draw = _uniform(config.range_ratio) if config.kind == "uniform" else _lognormal(config.sigma)
    return [(draw(rng, config.input_len), draw(rng, config.output_len)) for _ in range(num)]


def _uniform(ratio: float):
    def draw(rng: random.Random, mean: int) -> int:
        low, high = max(1, round(mean * (1 - ratio))), max(1, round(mean * (1 + ratio)))
        return rng.randint(low, high)

    return draw


def _lognormal(sigma: float):
    def draw(rng: random.Random, median: int) -> int:
        return max(1, round(rng.lognormvariate(math.log(median), sigma)))

    return draw


def _shared_prefix(config: WorkloadConfig, rng: random.Random):
    """K system prompts, M users each with a suffix of their own; every (k, m) pair, shuffled."""
    k_count, m_count = config.num_system_prompts, config.num_users
    systems = [
        tuple(rng.randrange(256) for _ in range(config.system_prompt_len)) for _ in range(k_count)
    ]
    pairs = [(k, m) for k in range(k_count) for m in range(m_count)]
    num = config.num_requests or len(pairs)
    order = [pairs[i % len(pairs)] for i in range(num)]
    rng.shuffle(order)
    suffixes = {
        pair: tuple(rng.randrange(256) for _ in range(config.user_len)) for pair in sorted(pairs)
    }
    prompts = [systems[k] + suffixes[(k, m)] for k, m in order]
    return prompts, [config.output_len] * num, [f"{k}/{m}" for k, m in order]
