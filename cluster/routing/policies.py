"""The registered routing policies: the default, and `make_policy` to build one from config.

Each policy registers itself by `name` when its class is defined
(`RoutingPolicy.__init_subclass__`, `cluster/routing/policy.py`); importing every family here is
what makes `RoutingPolicy.registry` whole for whoever imports this module (the config's choices,
the command lines). One family per module: `kv_aware.py`, `baselines.py` (`least_loaded`,
`round_robin`).
"""

from __future__ import annotations

from typing import Any

from pagedserve.cluster.routing.baselines import LeastLoadedPolicy, RoundRobinPolicy
from pagedserve.cluster.routing.kv_aware import KvAwarePolicy
from pagedserve.cluster.routing.policy import RoutingPolicy

DEFAULT_POLICY = KvAwarePolicy.name
# The requests light traffic packs one of the workers that share a machine's cores to before
# the next gets any (`KvAwarePolicy`, packing). On the 2-core machine of bench/README.md
# ("Cores that follow the load"), an engine alone on both cores delivered as much as two of
# one core each up to 4 sequences at once, and 1.06-1.27x less from 8 on: 6 is between.
PACK_BELOW_REQUESTS = 6
POLICIES: tuple[type[RoutingPolicy], ...] = (KvAwarePolicy, LeastLoadedPolicy, RoundRobinPolicy)


def policy_names() -> tuple[str, ...]:
    """Every registered policy's name, the default first, then the rest by name (the order
    `--help` and the docs list them in)."""
    return tuple(sorted(RoutingPolicy.registry, key=lambda name: (name != DEFAULT_POLICY, name)))


def options_of(name: str, options: dict[str, Any], share_cores: bool) -> dict[str, Any]:
    """The policy's options from the routing config: `options`, and where the workers share
    their machine's cores, `kv_aware` packing light traffic onto one of them
    (`pack_below_requests`: `PACK_BELOW_REQUESTS`) unless the options set it."""
    if share_cores and name == KvAwarePolicy.name:
        return {"pack_below_requests": PACK_BELOW_REQUESTS, **options}
    return dict(options)


def make_policy(
    name: str, *, engine_block_size: int | None = None, **options: Any
) -> RoutingPolicy:
    """Build the routing policy registered as `name` with its options; a policy that
    `takes_block_size` gets `engine_block_size` unless its options set one.

    Raises:
        ValueError: on an unknown name (listing the known ones) or an unknown option.
    """
    policy_class = RoutingPolicy.registry.get(name)
    if policy_class is None:
        raise ValueError(
            f"unknown routing policy {name!r}; known: {sorted(RoutingPolicy.registry)}"
        )
    if policy_class.takes_block_size and engine_block_size is not None:
        options.setdefault("block_size", engine_block_size)
    try:
        return policy_class(**options)
    except TypeError as error:
        raise ValueError(f"bad options for routing policy {name!r}: {error}") from error
