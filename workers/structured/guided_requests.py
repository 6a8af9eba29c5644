"""`GuidedRequests`: an engine's requests that carry a grammar, from arrival to their last token.

A request with a `GuidedSpec` waits here, outside the scheduler's queues, until its grammar is
compiled (`park`, then `admit_ready` each step); then every branch gets its own matcher and the
request is queued as any other. The matcher advances on every token the engine appends
(`stop_reason`), so preemption by recompute or swap keeps it as it is: the sequence keeps its
tokens. A sequence that continues on another worker (moved, replayed after a worker death,
handed from a prefill to a decode worker) arrives with its tokens only: its new matcher replays
the accepted output tokens (`attach`), which rebuilds exactly the state the source had.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

from pagedserve.workers.engine.request import Request
from pagedserve.workers.model.loader import LoadedModel
from pagedserve.workers.protocol.guided import GuidedSpec
from pagedserve.workers.protocol.stream import FinishReason
from pagedserve.workers.structured.backend import GrammarBackend
from pagedserve.workers.structured.compiler import DEFAULT_COMPILE_TIMEOUT_S, GrammarCompiler

# The longest an idle engine sleeps in one step waiting for a compile (it returns at once when
# one finishes): long enough not to spin, short enough that a new request is not held back.
IDLE_WAIT_S = 0.01


@dataclass
class _Parked:
    future: Future
    since: float
    on_ready: Callable[[Any], None]


class GuidedRequests:
    """Grammar compiles and matchers for one engine.

    Args:
        loaded: the engine's model (tokenizer, logits width, EOS ids); the backend is made for
            it on the first guided request, so an engine that never sees one pays nothing.
        compile_timeout_s: how long a request waits for its grammar before it fails.
    """

    def __init__(
        self, loaded: LoadedModel, compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    ) -> None:
        self.loaded = loaded
        self.compile_timeout_s = compile_timeout_s
        self._compiler: GrammarCompiler | None = None
        self._parked: dict[str, _Parked] = {}

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            from pagedserve.workers.structured.xgrammar_backend import XGrammarBackend

            backend = XGrammarBackend(
                self.loaded.tokenizer, self.loaded.vocab_size, self.loaded.eos_token_ids
            )
            self._compiler = GrammarCompiler(
                backend, self.loaded.name, timeout_s=self.compile_timeout_s
            )
        return self._compiler

    @property
    def backend(self) -> GrammarBackend | None:
        """The backend, once a guided request made it (sequences with matchers imply it)."""
        return None if self._compiler is None else self._compiler.backend

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def park(self, group_id: str, spec: GuidedSpec, on_ready: Callable[[Any], None]) -> None:
        """Compile `spec` off the step; `on_ready(compiled)` runs in `admit_ready` once it is."""
        future = self.compiler.submit(spec)
        self._parked[group_id] = _Parked(future, time.monotonic(), on_ready)

    def drop(self, group_id: str) -> None:
        """Forget a parked request (aborted, timed out)."""
        self._parked.pop(group_id, None)

    def admit_ready(self) -> list[tuple[str, str]]:
        """Run `on_ready` of every request whose grammar is compiled; the (group id, message)
        of those whose compile failed or ran past the time bound (the engine fails them)."""
        failed = []
        now = time.monotonic()
        for group_id, parked in list(self._parked.items()):
            if parked.future.done():
                del self._parked[group_id]
                error = parked.future.exception()
                if error is None:
                    parked.on_ready(parked.future.result())
                else:
                    failed.append((group_id, str(error)))
            elif now - parked.since >= self.compile_timeout_s:
                del self._parked[group_id]
                failed.append(
                    (group_id, f"the grammar did not compile within {self.compile_timeout_s} s")
                )
        return failed

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()

    def wait_for_compile(self, timeout_s: float = IDLE_WAIT_S) -> None:
        """Block until a parked compile finishes or `timeout_s` passed (an idle engine's step)."""
        if self._parked:
            wait([p.future for p in self._parked.values()], timeout_s, FIRST_COMPLETED)

    def attach(self, request: Request, compiled: Any) -> bool:
        """Give `request` a fresh matcher that replays its output so far; False when the
        output does not match the grammar (a handoff from an engine that did not hold it)."""
        matcher = self.compiler.new_matcher(compiled)
        for token in request.all_token_ids[request.prompt_len :]:
            if not matcher.accept_token(token):
                return False
        request.matcher = matcher
        return True


def guided_stop(request: Request, token: int) -> FinishReason | None:
    """Advance `request`'s matcher past its newest token: STOP once the grammar is complete,
    ERROR when the grammar refuses the token (no token satisfied every constraint at once)."""
    if request.matcher is None:
        return None
    if not request.matcher.accept_token(token):
        return FinishReason.ERROR
    return FinishReason.STOP if request.matcher.is_terminated() else None
