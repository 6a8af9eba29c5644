"""Processes a test started, found by a marker in their environment (they may have left the
test's process tree: Ray daemonizes its own)."""

from __future__ import annotations

from pathlib import Path

MARK_ENV = "PAGEDSERVE_TEST_MARK"


def processes_marked(marker: str) -> list[tuple[int, str]]:
    """(pid, command name) of every process whose environment holds `MARK_ENV=marker`."""
    needle = f"{MARK_ENV}={marker}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle in environ.read_bytes():
                command = (environ.parent / "comm").read_text().strip()
                found.append((int(environ.parent.name), command))
        except OSError:
            continue  # ended while we looked
    return found
