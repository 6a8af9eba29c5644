"""The gRPC soak's per-request checks on hand-made outcomes (no Ray, no server)."""

from support.soak.driver import KINDS, SoakRequest
from support.soak.grpc_calls import WIRE_BAD_INPUTS, GrpcOutcome, to_message
from support.soak.grpc_checks import ALLOWED, check_codes, check_details, check_tokens

from pagedserve.workers.protocol.sampling import SamplingParams


def outcome(kind: str = "ok", code: str = "OK", n: int = 1, **fields) -> GrpcOutcome:
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, n=n)
    fields.setdefault("finish_reasons", dict.fromkeys(range(n), "length") if code == "OK" else {})
    return GrpcOutcome(SoakRequest(7, kind, params, [1, 2, 3]), code, **fields)


def test_allowed_endings_pass():
    outcomes = [
        outcome(),
        outcome("burst", "RESOURCE_EXHAUSTED", retry_after="1"),
        outcome("cancel", "CANCELLED", client_cancelled=True),
        outcome("deadline", "OK", finish_reasons={0: "timeout"}),
        outcome("deadline", "DEADLINE_EXCEEDED"),
        outcome("bad", "INVALID_ARGUMENT", details="prompt is empty"),
        outcome("victim", "UNAVAILABLE", details="the router serving this request died"),
    ]
    assert check_codes(outcomes) == [] and check_details(outcomes) == []


def test_every_kind_the_soak_plans_has_its_allowed_endings():
    assert set(KINDS) <= set(ALLOWED), f"kinds without endings: {set(KINDS) - set(ALLOWED)}"


def test_internal_hung_and_unasked_cancel_are_problems():
    problems = check_codes(
        [outcome(code="INTERNAL"), outcome(code="HUNG"), outcome("cancel", "CANCELLED")]
    )
    assert len(problems) == 3
    assert "ended INTERNAL" in problems[0] and "ended HUNG" in problems[1]


def test_a_victim_must_end_unavailable_not_cancelled():
    (problem,) = check_codes([outcome("victim", "CANCELLED", client_cancelled=False)])
    assert "(victim) ended CANCELLED" in problem


def test_refusal_without_retry_after_is_a_problem():
    (problem,) = check_codes([outcome("burst", "RESOURCE_EXHAUSTED", details="queue is full")])
    assert "without retry-after" in problem


def test_ok_cut_short_is_a_problem():
    (problem,) = check_codes([outcome(n=2, finish_reasons={0: "length", 1: "abort"})])
    assert "finish reasons" in problem


def test_details_that_leak_internals():
    leaky = [
        'Traceback (most recent call last):\n  File "/x/router.py", line 3',
        "ray::ServeReplica (pid=4329, ip=10.0.0.2, actor_id=754faf3869010461dfb1fd4401000000)",
        "actor died\n\tpid: 7400\n\tip: 192.0.2.2",
        "connect to 10.1.2.3:6379 failed",
    ]
    problems = check_details([outcome(code="INTERNAL", details=d) for d in leaky])
    assert len(problems) == 4
    assert "a traceback" in problems[0] and "an actor id" in problems[1]
    assert "a pid" in problems[2] and "an address" in problems[3]


def test_tokens_exact_when_finished_prefix_when_cut():
    reference = {7: [5, 6, 7]}
    assert check_tokens([outcome(tokens={0: [5, 6, 7]})], reference) == []
    assert check_tokens([outcome("victim", "UNAVAILABLE", tokens={0: [5, 6]})], reference) == []
    assert len(check_tokens([outcome(tokens={0: [5, 6, 8]})], reference)) == 1
    assert len(check_tokens([outcome("victim", "UNAVAILABLE", tokens={0: [6]})], reference)) == 1


def test_wire_bad_inputs_go_out_as_raw_bytes():
    req = SoakRequest(3, "bad", SamplingParams(max_tokens=2), [1], bad_input="unknown_field")
    assert to_message(req) == WIRE_BAD_INPUTS["unknown_field"]
    req.bad_input = "empty"
    assert to_message(req).request_id == "soak-3"
