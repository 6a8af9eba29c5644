"""What a gRPC soak run must show, request by request (see `grpc_soak.py`): each check returns
the problems it found, as sentences naming the request; an empty list means it passed.

- Every request ends with a status code its kind allows (`ALLOWED`); INTERNAL, UNKNOWN, a
  CANCELLED the client did not ask for, or a hung call is always a problem.
- Every refusal (RESOURCE_EXHAUSTED) carries a `retry-after` trailing-metadata entry.
- No status details leak internals: a traceback, a source path, a pid, an address, an actor id.
- A request that ended OK ended as its kind says (a plain request: every branch by length).
- Greedy outputs equal the request run alone; a request cut short produced a prefix of it.
"""

from __future__ import annotations

import re

from support.soak.grpc_calls import GrpcOutcome

REFUSED = "RESOURCE_EXHAUSTED"

# The codes each kind of request may end with. `victim`: open when a Router replica is killed
# (UNAVAILABLE through the killed one, OK through a surviving one: `router_kill` checks which);
# `probe`: sent once the router is back; `dup`: a duplicate-id pair (checked as a pair too).
ALLOWED: dict[str, set[str]] = {
    "ok": {"OK", REFUSED},
    "burst": {"OK", REFUSED},
    "slow": {"OK", REFUSED},
    "cancel": {"OK", "CANCELLED", REFUSED},
    "deadline": {"OK", "DEADLINE_EXCEEDED", REFUSED},
    "bad": {"INVALID_ARGUMENT", REFUSED},
    "dup": {"OK", "INVALID_ARGUMENT"},
    "victim": {"UNAVAILABLE", "OK"},
    "probe": {"OK"},
}
# How a branch of a request that ended OK may have finished.
FINISH_REASONS: dict[str, set[str]] = {
    "deadline": {"length", "timeout"},
}
DEFAULT_FINISH_REASONS = {"length"}

# Internals a client must never see in status details.
LEAKS: dict[str, re.Pattern[str]] = {
    "a traceback": re.compile(r"Traceback"),
    "a source path": re.compile(r'\.py"|\.py:\d+|File "'),
    "a pid": re.compile(r"\bpid[=:]\s*\d+"),
    "an address": re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}:\d+\b"),
    "an actor id": re.compile(r"\b[0-9a-f]{32,}\b|ActorID\("),
}


def check_codes(outcomes: list[GrpcOutcome]) -> list[str]:
    """Each outcome's code against its kind; refusals with a retry hint; OK ends complete."""
    problems = []
    for o in outcomes:
        req = o.request
        where = f"request {req.index} ({req.kind}{', ' + req.bad_input if req.bad_input else ''})"
        if o.code not in ALLOWED[req.kind] or (o.code == "CANCELLED" and not o.client_cancelled):
            problems.append(f"{where} ended {o.code}: {o.details[:300]!r}")
        elif o.code == REFUSED and o.retry_after is None:
            problems.append(f"{where}: RESOURCE_EXHAUSTED without retry-after: {o.details!r}")
        elif o.code == "OK" and not o.client_cancelled:
            allowed = FINISH_REASONS.get(req.kind, DEFAULT_FINISH_REASONS)
            branches = set(range(req.params.n))
            if set(o.finish_reasons) != branches or set(o.finish_reasons.values()) - allowed:
                problems.append(f"{where} ended OK with finish reasons {o.finish_reasons}")
    return problems


def check_details(outcomes: list[GrpcOutcome]) -> list[str]:
    """No status details may show a traceback, a path, a pid, an address or an actor id."""
    problems = []
    for o in outcomes:
        found = [name for name, pattern in LEAKS.items() if pattern.search(o.details)]
        if found:
            problems.append(
                f"request {o.request.index} ({o.code}) details show {', '.join(found)}: "
                f"{o.details[:300]!r}"
            )
    return problems


def check_tokens(outcomes: list[GrpcOutcome], references: dict[int, list[int]]) -> list[str]:
    """Finished greedy requests equal the request run alone; partial ones are a prefix."""
    problems = []
    for o in outcomes:
        reference = references.get(o.request.index)
        if not o.tokens or reference is None:
            continue
        for branch, tokens in sorted(o.tokens.items()):
            exact = o.finished
            if (tokens != reference) if exact else (tokens != reference[: len(tokens)]):
                problems.append(
                    f"request {o.request.index} branch {branch} ({o.code}, "
                    f"{'finished' if exact else 'partial'}) differs from the request run "
                    f"alone: {tokens} vs {reference}"
                )
    return problems


def check_outcomes(outcomes: list[GrpcOutcome], references: dict[int, list[int]]) -> list[str]:
    """All the per-request checks."""
    return check_codes(outcomes) + check_details(outcomes) + check_tokens(outcomes, references)
