"""Structured outputs: a request's output held to a grammar (JSON object, JSON schema, regex,
choice, EBNF) token by token.

This package owns, for a grammar (`GuidedSpec`, in `workers/protocol/guided.py`: the one
description every front end builds and every worker receives), the backend behind one small
interface (`backend.GrammarBackend`: check a spec's syntax without a tokenizer, compile it for
one tokenizer, make a matcher per sequence; `xgrammar_backend.py` is the only implementation),
the engine's compile service (`compiler.GrammarCompiler`: a thread pool off the step, a cache of
compiled grammars by (tokenizer, spec) hash, a time bound), and the per-step token masks
(`masking.py`: the grammar bitmask for the whole batch, plus `logit_bias`, `allowed_token_ids`
and `bad_words`, applied to the logits before temperature, top-k and top-p). A sequence's
matcher advances on every token the engine appends; a sequence that continues elsewhere (moved,
replayed after a worker death, handed from a prefill to a decode worker) gets a fresh matcher on
the new worker that replays its accepted output tokens (see docs/structured_outputs.md).
"""
