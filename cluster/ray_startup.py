"""Ray's start-up deadlines, raised so that a loaded machine starts a local cluster.

A local Ray (`ray.init(address="local")`) starts its raylet, which waits for its dashboard
agent to register (`agent_register_timeout_ms`, 30 s by default) and for each worker process
it spawns (`worker_register_timeout_seconds`, 60 s). Past either deadline Ray gives up: the
raylet crashes with "Check failed" in `WaitForDashboardAgentPorts` (seen at a load average of
~45 on this project's 2-core machines: the integration tests' `ray.init` failed and every
test of the module errored), or a late worker is killed and respawned. Slowness is not a
failure here, so every local cluster this project starts allows minutes instead.

Serve's controller gives a new proxy 5 s to report ready (`RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S`),
then kills and restarts it: at a load average of ~40 a proxy missed it again and again, and a
test module's set-up, waiting on the proxy actor, failed with `ActorDiedError` (killed by
`ray.kill`). That deadline is raised the same way.

Ray's raylet has one more deadline it takes from nowhere: the driver waits 30 s for a starting
node to register with the GCS (`ray._private.node`, a constant). At a load average of ~45 it
ran out ("The current node timed out during startup"); nothing here can raise it.

Set any of these variables in the environment to choose another value; a joined cluster keeps
its own.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

STARTUP_DEADLINES: dict[str, str] = {
    "RAY_agent_register_timeout_ms": "300000",
    "RAY_worker_register_timeout_seconds": "300",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120",
}


def allow_slow_startup(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set Ray's start-up deadlines (`STARTUP_DEADLINES`) where the environment has none.

    Call it before `ray.init` starts a local cluster: its processes read them as they start.
    """
    for name, value in STARTUP_DEADLINES.items():
        environ.setdefault(name, value)
