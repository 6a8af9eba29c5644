"""`GrammarCompiler`: compiles specs off the engine's step and keeps what it compiled.

A compile can take from a millisecond (a cached schema) to seconds (a large grammar over a large
vocabulary), so it never runs inside `Engine.step`: `submit` hands it to a small thread pool and
returns a future the engine polls each step (the request waits meanwhile, outside the
scheduler's queues). Compiled grammars are kept by `(tokenizer key, spec.cache_key)`, up to
`max_cached` of them, least recently used first out; a spec submitted while it still compiles
shares the one compile. A compile still running after `timeout_s` fails its requests; its
thread cannot be stopped (xgrammar compiles in C++), so it keeps one of the pool's threads until
it ends, and the others keep serving.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pagedserve.workers.protocol.guided import GuidedSpec
from pagedserve.workers.structured.backend import GrammarBackend, Matcher

DEFAULT_COMPILE_THREADS = 2
DEFAULT_COMPILE_TIMEOUT_S = 30.0
DEFAULT_MAX_CACHED = 256


class GrammarCompiler:
    """One engine's compile pool and cache of compiled grammars.

    Args:
        backend: the grammar backend, made for the engine's tokenizer.
        tokenizer_key: names the tokenizer (its model), the other half of the cache key.
        num_threads: compiles that may run at once.
        timeout_s: how long a request waits for its grammar before it fails.
        max_cached: compiled grammars kept.
    """

    def __init__(
        self,
        backend: GrammarBackend,
        tokenizer_key: str,
        *,
        num_threads: int = DEFAULT_COMPILE_THREADS,
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        max_cached: int = DEFAULT_MAX_CACHED,
    ) -> None:
        self.backend = backend
        self.tokenizer_key = tokenizer_key
        self.timeout_s = timeout_s
        self.max_cached = max_cached
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar-compile")
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.num_compiles = 0
        self.num_cache_hits = 0

    def submit(self, spec: GuidedSpec) -> Future:
        """A future of `spec`'s compiled grammar: the cached one, or a compile just started."""
        key = (self.tokenizer_key, spec.cache_key)
        future = self._compiled.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._compiled.move_to_end(key)
            self.num_cache_hits += 1
            return future
        future = self._pool.submit(self.backend.compile, spec)
        self.num_compiles += 1
        self._compiled[key] = future
        while len(self._compiled) > self.max_cached:
            self._compiled.popitem(last=False)
        return future

    def compile_now(self, spec: GuidedSpec) -> Any:
        """`spec` compiled, waiting at most `timeout_s` (for callers off the step)."""
        return self.submit(spec).result(timeout=self.timeout_s)

    def new_matcher(self, compiled: Any) -> Matcher:
        return self.backend.new_matcher(compiled)

    def close(self) -> None:
        """Stop taking compiles; running ones finish on their own."""
        self._pool.shutdown(wait=False, cancel_futures=True)
