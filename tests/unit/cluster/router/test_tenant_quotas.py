"""Per-tenant admission on its own (an injected clock): in-flight quotas, the token bucket and
its retry hint, the config's `tenants` and the weights it gives every worker's scheduler."""

from __future__ import annotations

import pytest
from support.clock import ManualClock

from pagedserve.cluster.api.auth import TokenAuth, tenant_of
from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.router.tenant_quotas import (
    TenantAdmission,
    TenantPolicy,
    TenantQuotaExceeded,
    tenant_policies,
)
from pagedserve.workers.protocol.errors import Overloaded, RequestRejected


def test_inflight_quota_refuses_past_the_limit_and_frees_on_leave():
    admission = TenantAdmission({"a": TenantPolicy(max_inflight=2)}, retry_after_s=3.0)
    admission.enter("a")
    admission.enter("a")
    with pytest.raises(TenantQuotaExceeded) as refused:
        admission.enter("a")
    assert isinstance(refused.value, Overloaded) and refused.value.retry_after_s == 3.0
    assert admission.inflight == {"a": 2}  # the refused one was not counted
    for _ in range(50):  # another tenant has no quota: never refused
        admission.enter("b")
    admission.leave("a")
    admission.enter("a")
    assert admission.inflight == {"a": 2, "b": 50}


def test_every_tenant_policy_applies_to_tenants_not_named():
    policies = tenant_policies({"*": {"max_inflight": 1}, "vip": {"weight": 2.0}})
    admission = TenantAdmission(policies)
    admission.enter("someone")
    with pytest.raises(TenantQuotaExceeded):
        admission.enter("someone")
    admission.enter("vip")
    admission.enter("vip")  # named: its own policy (no quota), not `*`'s


def test_token_bucket_refuses_with_the_seconds_until_it_holds_enough():
    clock = ManualClock()
    admission = TenantAdmission({"a": TenantPolicy(tokens_per_minute=600)}, 1.0, clock)
    admission.take_tokens("a", 500)  # 100 left; refills 10 a second
    with pytest.raises(TenantQuotaExceeded) as refused:
        admission.take_tokens("a", 300)
    assert refused.value.retry_after_s == 20  # (300 - 100) / 10
    clock.now = 20.0
    admission.take_tokens("a", 300)  # now it holds 300
    admission.give_back("a", 1000)  # capped at a minute's worth
    admission.take_tokens("a", 600)
    with pytest.raises(RequestRejected, match="max_tokens") as never:
        admission.take_tokens("a", 601)
    assert not isinstance(never.value, Overloaded)  # it can never pass: not a retry


def test_tenant_policies_name_the_bad_key_or_value():
    with pytest.raises(ValueError, match=r"tenants\['a'\]: unknown keys rate"):
        tenant_policies({"a": {"rate": 1}})
    with pytest.raises(ValueError, match=r"tenants\['a'\]\.max_inflight must be"):
        tenant_policies({"a": {"max_inflight": 0}})
    with pytest.raises(ValueError, match="weight"):
        ClusterConfig.from_dict({"tenants": {"a": {"weight": -1}}})


def test_the_cluster_config_gives_workers_the_tenants_weights():
    config = ClusterConfig.from_dict(
        {"tenants": {"*": {"weight": 0.5}, "a": {"weight": 3.0, "max_inflight": 4}}}
    )
    fair_share = config.worker_engine.fair_share
    assert fair_share.enabled and fair_share.weight("a") == 3.0
    assert fair_share.weight("b") == 0.5 and "*" not in fair_share.tenant_weights
    off = ClusterConfig.from_dict({"engine": {"fair_share": {"enabled": False}}})
    assert not off.worker_engine.fair_share.enabled


def test_tenant_of_is_the_id_auth_gives_the_token():
    assert TokenAuth(["tok"]).check("Bearer tok").tenant == tenant_of("tok")
    assert len(tenant_of("tok")) == 16
