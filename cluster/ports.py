"""Free TCP ports for the local apps that tests and benchmarks start.

A port asked of the kernel with `bind(("", 0))` comes from the ephemeral range, the same
range every outgoing connection and every Ray process that binds port 0 draws from; between
our probe and Serve's own bind one of them can take it (CI saw Serve's HTTP proxy fail with
"Failed to bind to address"). So the ports handed out here lie below the ephemeral range and
above Ray's worker port range, where the kernel never allocates on its own, and one process
never hands out the same port twice.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

RAY_WORKER_PORTS_END = 19_999  # ray start's default --max-worker-port
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")

_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that binds now, outside the kernel's ephemeral range."""
    low, high = _quiet_range()
    candidates = random.sample(range(low, high), k=min(2_000, high - low))
    for port in candidates:
        if port not in _handed_out and _binds(host, port):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port on {host} in [{low}, {high})")


def _quiet_range() -> tuple[int, int]:
    """Ports the kernel never picks by itself: above Ray's workers, below the ephemeral range."""
    try:
        ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32_768  # Linux's default
    low = RAY_WORKER_PORTS_END + 1
    if ephemeral_low - low < 1_000:  # an unusual range: fall back to the kernel's choice
        return 1_024, 65_535
    return low, ephemeral_low


def _binds(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
