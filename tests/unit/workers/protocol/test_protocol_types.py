"""The protocol package's rule (`workers/protocol/__init__.py`): every class it defines is a
dataclass, and a frozen one, unless it is listed here with the reason it is not. The lists are
exact: freezing a listed type, or adding a type that breaks the rule, fails a test until the
list says so."""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import pkgutil
import subprocess
import sys

import pytest

import pagedserve.workers.protocol as protocol

# Dataclasses that still cross mutable: (module, class) → why (who assigns to its fields).
MUTABLE = {
    ("stats", "SchedulerCounters"): "the scheduler's own running counters; `WorkerStats` "
    "carries a copy",
    ("stats", "TenantService"): "the fair-share scheduler's running counts per tenant; "
    "`WorkerStats.tenants` carries copies",
}
# Classes that are not dataclasses by design, beside exceptions and enums (allowed by kind:
# an error is raised, not built as a message; an enum is a value).
NOT_DATACLASSES = {
    ("sampling", "SamplingKwargs"): "a TypedDict: the keyword arguments of `SamplingParams` "
    "for typed callers, never sent",
    ("stream", "TopLogprob"): "a NamedTuple (immutable): one of a position's top tokens",
}


def protocol_classes() -> list[tuple[tuple[str, str], type]]:
    found = []
    for info in pkgutil.iter_modules(protocol.__path__):
        module = importlib.import_module(f"{protocol.__name__}.{info.name}")
        for name, value in vars(module).items():
            defined_here = inspect.isclass(value) and value.__module__ == module.__name__
            if defined_here and not name.startswith("_"):
                found.append(((info.name, name), value))
    return found


CLASSES = protocol_classes()


def by_kind(cls: type) -> bool:
    return issubclass(cls, (BaseException, enum.Enum))


def test_the_package_has_its_modules():
    modules = {key[0] for key, _ in CLASSES}
    assert modules >= {"errors", "events", "guided", "handoff", "requests", "role", "sampling"}
    assert modules >= {"stats", "stream"}


@pytest.mark.parametrize(("key", "cls"), CLASSES, ids=[".".join(key) for key, _ in CLASSES])
def test_every_class_is_a_frozen_dataclass_or_listed(key, cls):
    if by_kind(cls):
        return
    if key in NOT_DATACLASSES:
        assert not dataclasses.is_dataclass(cls), f"{key} is a dataclass now: unlist it"
        return
    assert dataclasses.is_dataclass(cls), f"{key} crosses a process boundary: a dataclass"
    frozen = cls.__dataclass_params__.frozen
    if key in MUTABLE:
        assert not frozen, f"{key} is frozen now: take it off MUTABLE"
    else:
        assert frozen, f"{key} is a mutable dataclass: freeze it, or list it with a reason"


def test_every_listed_exception_still_exists():
    keys = {key for key, _ in CLASSES}
    assert set(MUTABLE) <= keys
    assert set(NOT_DATACLASSES) <= keys


def test_a_frozen_message_refuses_assignment():
    from pagedserve.workers.protocol.errors import RequestRejected
    from pagedserve.workers.protocol.stream import RequestFailed

    message = RequestFailed("r1", RequestRejected("gone"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.request_id = "r2"  # type: ignore[misc]


def test_the_package_imports_without_torch_or_ray():
    """Every process (router, front ends, control actors) imports these: no torch, no Ray."""
    names = sorted({key[0] for key, _ in CLASSES})
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module('pagedserve.workers.protocol.' + name)\n"
        "heavy = [m for m in ('torch', 'ray', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
