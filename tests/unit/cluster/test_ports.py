"""Ports for local apps come from outside the kernel's ephemeral range and are never repeated."""

import random
import socket

import pagedserve.cluster.ports as ports_module
from pagedserve.cluster.ports import _quiet_range, free_port


def test_ports_are_outside_the_ephemeral_range_distinct_and_bindable():
    low, high = _quiet_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(low <= port < high for port in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_a_port_in_use_is_skipped(monkeypatch):
    low, _ = _quiet_range()
    monkeypatch.setattr(ports_module, "_handed_out", set())  # earlier tests may have had `busy`
    with socket.socket() as taken:
        for port in range(low, low + 100):  # hold one port of the quiet range
            try:
                taken.bind(("127.0.0.1", port))
                break
            except OSError:
                continue
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(random, "sample", lambda seq, k: [busy, *range(busy + 1, busy + 50)])
        assert free_port() not in (busy,)
        assert busy not in ports_module._handed_out
