"""Error mapping, bearer-token auth and the API config, without Ray or a network."""

from __future__ import annotations

import hashlib

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from pagedserve.cluster.api.auth import Caller, TokenAuth, read_tokens_file
from pagedserve.cluster.api.config import ApiConfig, AuthConfig, split_app_args
from pagedserve.cluster.api.errors import (
    HTTP_STATUS,
    OPENAI_ERROR_TYPE,
    ApiError,
    ErrorCode,
    as_api_error,
    field_of,
)
from pagedserve.cluster.app import build_app
from pagedserve.workers.protocol.errors import (
    NoWorkerAvailable,
    Overloaded,
    RequestRejected,
    RequestTooLarge,
)
from pagedserve.workers.protocol.requests import GenerateRequest
from pagedserve.workers.protocol.sampling import SamplingParams


# ------------------------------------------------------------------ mapping
def from_worker(error: Exception) -> Exception:
    """What a rejection raised inside a worker looks like once Ray hands it back."""
    return RayTaskError(
        "generate", "Traceback (most recent call last): ...", error
    ).as_instanceof_cause()


@pytest.mark.parametrize(
    "error, code",
    [
        (RequestRejected("prompt is empty"), ErrorCode.INVALID_ARGUMENT),
        (RequestTooLarge("can never fit in the KV pool"), ErrorCode.RESOURCE_EXHAUSTED),
        (from_worker(RequestTooLarge("can never fit")), ErrorCode.RESOURCE_EXHAUSTED),
        (from_worker(RequestRejected("prompt_token_ids holds ids")), ErrorCode.INVALID_ARGUMENT),
        (NoWorkerAvailable("no worker is alive"), ErrorCode.UNAVAILABLE),
        (ActorDiedError(), ErrorCode.UNAVAILABLE),
    ],
)
def test_router_and_worker_failures_map_to_codes(error, code):
    assert as_api_error(error).code is code


def test_a_worker_rejection_keeps_its_own_message():
    error = as_api_error(from_worker(RequestRejected("prompt_token_ids holds ids outside")))
    assert error.message == "prompt_token_ids holds ids outside"
    assert error.param == "prompt_token_ids"


def test_anything_else_is_not_an_api_error():
    assert as_api_error(KeyError("bug")) is None
    assert as_api_error(ValueError("temperature must be >= 0")) is None  # only via SamplingParams


@pytest.mark.parametrize(
    "message, field",
    [
        ("temperature must be >= 0, got -1", "temperature"),
        ("stop[1] must be a non-empty string", "stop[1]"),
        ("prompt is empty", "prompt"),
        ("sampling.stop[0] is not valid UTF-8", "sampling.stop[0]"),
        ("messages[0].content: Input should be a valid string", "messages[0].content"),
        ("prompt (3 tokens) + max_tokens (9) exceeds the model's context", None),
        ("the request body is not valid JSON", None),
    ],
)
def test_field_of_reads_the_leading_field(message, field):
    assert field_of(message) == field


def test_every_code_has_an_http_form():
    for code in ErrorCode:
        assert code in HTTP_STATUS and code in OPENAI_ERROR_TYPE
    assert HTTP_STATUS[ErrorCode.RESOURCE_EXHAUSTED] == 400  # never 429: retrying cannot help


@pytest.mark.parametrize("wrap", [lambda e: e, from_worker], ids=["router", "worker"])
def test_overloaded_is_429_with_a_retry_hint(wrap):
    error = as_api_error(wrap(Overloaded("the engine's waiting queue is full (4)", 2.5)))
    assert error.code is ErrorCode.RESOURCE_EXHAUSTED
    assert error.message == "the engine's waiting queue is full (4)"
    assert error.http_status == 429 and error.openai_type == "rate_limit_error"
    assert error.retry_after_s == 2.5 and error.retry_after_header() == "3"


def test_overloaded_keeps_its_hint_across_pickling():
    import pickle

    error = pickle.loads(pickle.dumps(Overloaded("full", 0.2)))
    assert isinstance(error, Overloaded) and str(error) == "full" and error.retry_after_s == 0.2
    assert as_api_error(error).retry_after_header() == "1"  # whole seconds, at least 1


def test_too_large_stays_400_without_a_hint():
    error = as_api_error(RequestTooLarge("can never fit"))
    assert error.http_status == 400 and error.retry_after_header() is None


# --------------------------------------------------------------------- auth
def test_auth_off_lets_everything_through():
    auth = TokenAuth()
    assert not auth.enabled
    assert auth.check(None) == auth.check_metadata([]) == Caller("", "")


def test_each_token_is_a_tenant_with_a_cache_of_its_own():
    auth = TokenAuth(["alpha", "beta", "gamma team-1", "delta team-1"])
    alpha, beta, gamma, delta = (
        auth.check(f"Bearer {t}") for t in ("alpha", "beta", "gamma", "delta")
    )
    # The tenant is a digest prefix, never the token.
    assert alpha.tenant == hashlib.sha256(b"alpha").hexdigest()[:16]
    assert alpha.cache_scope == f"tenant:{alpha.tenant}" != beta.cache_scope
    # Tokens of one cache group share a cache, yet stay tenants of their own (request ids).
    assert gamma.cache_scope == delta.cache_scope == "group:team-1"
    assert gamma.tenant != delta.tenant
    shared = TokenAuth(["alpha", "beta"], isolate_caches=False)
    assert shared.check("Bearer alpha").cache_scope == shared.check("Bearer beta").cache_scope == ""


@pytest.mark.parametrize(
    "entry, message",
    [("a b c", "3 fields"), ("tok grp/1", "cache group 'grp/1'"), ("tok " + "g" * 65, "1-64")],
)
def test_bad_token_entries_are_named(entry, message):
    with pytest.raises(ValueError, match=message):
        TokenAuth(["fine", entry])


def test_the_prefix_salt_is_the_scope_then_the_clients_salt():
    params = SamplingParams()
    assert GenerateRequest(params).prefix_salt is None
    assert GenerateRequest(params, cache_salt="x").prefix_salt == "x"
    assert GenerateRequest(params, cache_scope="tenant:ab").prefix_salt == "tenant:ab"
    scoped = GenerateRequest(params, cache_salt="x", cache_scope="tenant:ab")
    assert scoped.prefix_salt == "tenant:ab/x"
    # A client's salt cannot name another scope: its own always comes first.
    other = GenerateRequest(params, cache_salt="tenant:cd", cache_scope="tenant:ab")
    assert other.prefix_salt != "tenant:cd"


@pytest.mark.parametrize("header", ["Bearer s3cret", "bearer s3cret", "Bearer   s3cret  "])
def test_a_listed_token_passes(header):
    TokenAuth(["other", "s3cret"]).check(header)


@pytest.mark.parametrize(
    "header, reason",
    [(None, "missing"), ("", "missing"), ("s3cret", "missing"), ("Bearer wrong", "invalid")],
)
def test_missing_or_wrong_tokens_are_unauthenticated(header, reason):
    with pytest.raises(ApiError) as raised:
        TokenAuth(["s3cret"]).check(header)
    assert raised.value.code is ErrorCode.UNAUTHENTICATED
    assert reason in raised.value.message and raised.value.param == "authorization"


def test_grpc_metadata_is_read_case_insensitively():
    auth = TokenAuth(["s3cret"])
    auth.check_metadata([("user-agent", "x"), ("authorization", "Bearer s3cret")])
    with pytest.raises(ApiError):
        auth.check_metadata([("user-agent", "x")])


def test_tokens_file(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# team tokens\n\nalpha\n  beta  team-2\n", encoding="utf-8")
    assert read_tokens_file(str(path)) == ["alpha", "beta  team-2"]
    auth = TokenAuth.from_config(AuthConfig(tokens=("gamma team-2",), tokens_file=str(path)))
    scopes = {
        token: auth.check(f"Bearer {token}").cache_scope for token in ("alpha", "beta", "gamma")
    }
    assert scopes["beta"] == scopes["gamma"] == "group:team-2" != scopes["alpha"]
    (tmp_path / "empty").write_text("# nothing\n", encoding="utf-8")
    with pytest.raises(ValueError, match="holds no token"):
        read_tokens_file(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="cannot read"):
        read_tokens_file(str(tmp_path / "missing"))


# ------------------------------------------------------------------- config
def test_split_app_args_takes_the_api_keys_out():
    cluster, api = split_app_args(
        {"num_workers": 3, "auth": {"tokens": ["t"]}, "served_model_name": "tiny"}
    )
    assert cluster == {"num_workers": 3}
    assert api == ApiConfig(auth=AuthConfig(tokens=("t",)), served_model_name="tiny")
    assert split_app_args(None) == ({}, ApiConfig())


@pytest.mark.parametrize(
    "auth, match",
    [
        ({"token": ["t"]}, "unknown auth keys: token"),
        ({"tokens": "t"}, "auth.tokens must be a list"),
        ({"tokens": [""]}, r"auth.tokens\[0\]"),
    ],
)
def test_bad_auth_config_is_named(auth, match):
    with pytest.raises(ValueError, match=match):
        split_app_args({"auth": auth})


def test_build_app_checks_the_tokens_file_before_deploying(tmp_path):
    with pytest.raises(ValueError, match="auth.tokens_file"):
        build_app({"auth": {"tokens_file": str(tmp_path / "missing")}})
    with pytest.raises(ValueError, match="unknown cluster config keys: bogus"):
        build_app({"bogus": 1})
    assert build_app({"num_workers": 1, "auth": {"tokens": ["t"]}}) is not None


def test_overloaded_http_response_is_429_with_retry_after():
    import json

    from pagedserve.cluster.api.openai.api import error_response

    response = error_response(as_api_error(Overloaded("the router streams its limit", 2.0)))
    assert response.status_code == 429 and response.headers["retry-after"] == "2"
    body = json.loads(response.body)
    assert body["error"]["type"] == "rate_limit_error"
    assert body["error"]["code"] == "resource_exhausted"


def test_unforeseen_errors_and_lost_actors_reach_clients_without_internals(caplog):
    from ray.exceptions import ActorDiedError

    from pagedserve.cluster.api.errors import to_api_error

    bug = to_api_error(KeyError("secret path /srv/x.py"))
    assert bug.code.value == "INTERNAL" and bug.message.startswith("internal error (incident ")
    assert "/srv" not in bug.message
    incident = bug.message.split("incident ")[1].rstrip(")")
    assert incident in caplog.text, "the log holds the same incident id"
    lost = to_api_error(ActorDiedError())
    assert lost.code.value == "UNAVAILABLE" and "actor" not in lost.message.lower()
