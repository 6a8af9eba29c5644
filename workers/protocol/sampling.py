"""Per-request sampling parameters, validated once at the edge.

Every check raises ``ValueError`` whose message starts with the field's name, so the router can
hand it back as ``INVALID_ARGUMENT`` unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypedDict

from pagedserve.workers.beam.checks import check_beam_search
from pagedserve.workers.protocol.guided import GuidedSpec

MAX_N = 64

# Temperatures this small would overflow ``logits / temperature``; they mean "greedy" anyway.
GREEDY_TEMPERATURE = 1e-5
# OpenAI's range for presence_penalty and frequency_penalty (vLLM checks the same).
MAX_ABS_PENALTY = 2.0
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit (vLLM's default max_logprobs too)
# Seeds are what a torch generator takes, [0, 2**64): a seed outside would wrap silently (-1
# sampling exactly as 2**64 - 1), so a client sending one gets an error instead.
SEED_LIMIT = 2**64
# Every stop string is matched against the held-back text after every token, and every stop
# token id against the newest token: unbounded lists let one request slow its worker's steps
# for everyone (5,000 stop strings cost ~4 ms a token of detokenizing; 64 of 256 characters
# cost 0.08 ms).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
# OpenAI's logit_bias: at most 300 ids, each biased by [-100, 100] (-100 bans, 100 forces).
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_ABS_LOGIT_BIAS = 100.0
# Banned words are matched against the output's last tokens every step: bounded like stops.
MAX_BAD_WORDS = 64
MAX_ALLOWED_TOKEN_IDS = 1 << 20


class Pooling(StrEnum):
    """How an embedding request pools the final hidden states of its prompt
    (`workers/engine/pooling.py`)."""

    LAST = "last"  # the last prompt position's (vLLM's default for decoder models)
    MEAN = "mean"  # the mean over every prompt position


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token of one request, and when to stop.

    Attributes:
        n: number of independent completions (branches) of the prompt, 1..64.
        max_tokens: most tokens to generate per branch.
        temperature: softmax temperature; 0 (or below 1e-5) means greedy.
        top_p: nucleus sampling; keep the smallest set of tokens whose mass is >= top_p.
        top_k: keep the k most likely tokens; 0 or -1 turns it off.
        seed: makes sampling reproducible, in [0, 2**64); branch j of a seeded request uses
            ``seed + j`` (modulo 2**64).
        stop: strings that end generation when they appear in the output text; at most 64,
            each of 1..512 characters.
        stop_token_ids: token ids that end generation (like EOS, but never ignored); at
            most 1,024.
        ignore_eos: keep generating past EOS.
        min_tokens: no EOS or ``stop_token_ids`` stop before this many output tokens.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        presence_penalty: subtracted from the logit of every token already in the output,
            in [-2, 2] (as vLLM and OpenAI define it).
        frequency_penalty: subtracted once per occurrence in the output, in [-2, 2].
        repetition_penalty: tokens in the prompt or the output get their logit divided by it
            when positive, multiplied by it when negative; > 0, 1 is off (vLLM, HF).
        logprobs: report the log-probability of every generated token with this many most
            likely alternatives (0..20); ``None``: none.
        prompt_logprobs: the same for every prompt token but the first (what evaluation
            harnesses score); ``None``: none. Such a request never reuses cached prefix blocks.
        pooling: make this an embedding request (`workers/engine/pooling.py`): a prefill only, whose
            result is the prompt's final hidden states pooled this way (`Pooling`: "last" or
            "mean") and L2-normalised, instead of tokens; ``n`` must be 1 and no
            log-probabilities are asked. ``None``: generate.
        guided: a grammar the output must match (`GuidedSpec`: JSON object, JSON schema, regex,
            choice, EBNF); ``None``: unconstrained. Generation ends once the grammar is complete.
        logit_bias: token id → a bias in [-100, 100] added to its logit every step (at most 300
            ids); ids are checked against the model's vocabulary when the request arrives.
        allowed_token_ids: only these ids may be generated; ``None``: all.
        bad_words: words never generated (each banned as the model's tokens spell it, with and
            without a leading space); at most 64.
        use_beam_search: beam search of width ``n`` (>= 2) inside the engine
            (`workers/beam/groups.py`): the ``n`` best hypotheses by cumulative log-probability
            (log-softmax of the raw logits), best first, as HF's ``generate(num_beams=n)``. It
            is deterministic: ``temperature`` must be 0 and no other sampling field (``top_p``,
            ``top_k``, ``seed``, penalties, ``min_tokens``, ``logit_bias``,
            ``allowed_token_ids``, ``bad_words``, ``guided``, ``stop``, log-probabilities,
            ``pooling``) may be set. EOS and ``stop_token_ids`` finish a hypothesis.
        length_penalty: a finished hypothesis scores its summed log-probability over its
            length (generated tokens, the stop token included) to this power (HF's); beam
            search only.
        early_stopping: when a beam search ends (HF's): True, once ``n`` hypotheses are
            finished; False, once no live beam can beat them at its current length; "never",
            once none can at ``max_tokens`` (with ``length_penalty`` > 0); beam search only.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    pooling: Pooling | None = None
    guided: GuidedSpec | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        # Normalised once, here, where it is built (frozen: `object.__setattr__`).
        normalise = functools.partial(object.__setattr__, self)
        normalise("stop", _as_list("stop", self.stop))
        normalise("stop_token_ids", _as_list("stop_token_ids", self.stop_token_ids))
        normalise("bad_words", _as_list("bad_words", self.bad_words))
        if self.allowed_token_ids is not None:
            normalise("allowed_token_ids", _as_list("allowed_token_ids", self.allowed_token_ids))
        normalise("logit_bias", _as_bias("logit_bias", self.logit_bias))
        self._validate_counts()
        self._validate_sampling()
        self._validate_stops()
        self._validate_constraints()
        self._validate_pooling()
        check_beam_search(self)

    def _validate_pooling(self) -> None:
        if self.pooling is None:
            return
        try:
            object.__setattr__(self, "pooling", Pooling(self.pooling))
        except ValueError:
            kinds = ", ".join(kind.value for kind in Pooling)
            raise ValueError(f"pooling must be one of {kinds}, got {self.pooling!r}") from None
        if self.n != 1:
            raise ValueError(f"n must be 1 for an embedding (pooling), got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: an embedding (pooling) has no log-probabilities")
        if self.guided is not None:
            raise ValueError("guided: an embedding (pooling) generates no tokens to constrain")

    def _validate_counts(self) -> None:
        _check_int("n", self.n)
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )

    def _validate_sampling(self) -> None:
        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= -1 (0 or -1: off), got {self.top_k}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not 0 <= self.seed < SEED_LIMIT:
                raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        _check_bool("ignore_eos", self.ignore_eos)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        self._validate_penalties()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value)
            if not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    def _validate_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids has {len(self.stop_token_ids)} ids; "
                f"at most {MAX_STOP_TOKEN_IDS} are allowed"
            )
        for i, stop in enumerate(self.stop):
            if not isinstance(stop, str):
                raise ValueError(f"stop[{i}] must be a str, got {stop!r}")
            if not stop:
                raise ValueError(f"stop[{i}] must be a non-empty string")
            if len(stop) > MAX_STOP_CHARS:
                raise ValueError(
                    f"stop[{i}] has {len(stop)} characters; at most {MAX_STOP_CHARS} are allowed"
                )
        for i, token_id in enumerate(self.stop_token_ids):
            _check_int(f"stop_token_ids[{i}]", token_id)
            if token_id < 0:
                raise ValueError(f"stop_token_ids[{i}] must be >= 0, got {token_id}")

    def _validate_constraints(self) -> None:
        if self.guided is not None and not isinstance(self.guided, GuidedSpec):
            raise ValueError(f"guided must be a GuidedSpec, got {self.guided!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(
                f"logit_bias has {len(self.logit_bias)} entries; "
                f"at most {MAX_LOGIT_BIAS_ENTRIES} are allowed"
            )
        for token_id, bias in self.logit_bias.items():
            _check_token_id(f"logit_bias[{token_id!r}]", token_id)
            _check_float(f"logit_bias[{token_id}]", bias)
            if not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{token_id}] must be in [-100, 100], got {bias}")
        if self.allowed_token_ids is not None:
            if not 1 <= len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(
                    f"allowed_token_ids must hold 1..{MAX_ALLOWED_TOKEN_IDS} ids, "
                    f"got {len(self.allowed_token_ids)}"
                )
            for i, token_id in enumerate(self.allowed_token_ids):
                _check_token_id(f"allowed_token_ids[{i}]", token_id)
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words has {len(self.bad_words)} words; at most {MAX_BAD_WORDS}")
        for i, word in enumerate(self.bad_words):
            if not isinstance(word, str) or not word.strip():
                raise ValueError(f"bad_words[{i}] must be a non-blank string, got {word!r}")
            if len(word) > MAX_STOP_CHARS:
                raise ValueError(f"bad_words[{i}] has more than {MAX_STOP_CHARS} characters")

    def token_ids_to_check(self) -> dict[str, list[int]]:
        """Field name → the token ids it names, for the engine's vocabulary check."""
        return {
            "logit_bias": list(self.logit_bias),
            "allowed_token_ids": list(self.allowed_token_ids or ()),
            "stop_token_ids": list(self.stop_token_ids),
        }

    @property
    def has_token_constraints(self) -> bool:
        """Whether the logits of this request are masked or biased before sampling."""
        return bool(
            self.guided is not None
            or self.logit_bias
            or self.allowed_token_ids is not None
            or self.bad_words
        )

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty changes the logits (all off by default)."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def is_greedy(self) -> bool:
        """Whether the next token is simply the argmax (temperature 0, or top_k 1)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def for_branch(self, index: int) -> SamplingParams:
        """The parameters of branch ``index`` of an ``n``-way request.

        Branch ``j`` samples exactly like the same request run alone with ``n=1`` and
        ``seed + j`` (wrapped into [0, 2**64), as a generator would take it), so branches are
        reproducible one by one; branch 0 keeps the seed.

        Args:
            index: the branch, in ``[0, n)``.

        Returns:
            A copy with ``n=1`` and the branch's seed (``None`` stays ``None``).
        """
        _check_int("index", index)
        if not 0 <= index < self.n:
            raise ValueError(f"index must be in [0, n={self.n}), got {index}")
        seed = None if self.seed is None else (self.seed + index) % SEED_LIMIT
        return dataclasses.replace(self, n=1, seed=seed)


class SamplingKwargs(TypedDict, total=False):
    """Keyword arguments of `SamplingParams`, as a front end gathers them from a request: a
    key left out takes the field's default. `stop` and `stop_token_ids` may be one string, any
    iterable or None, as `SamplingParams` normalises them (a test keeps the keys equal to the
    dataclass's fields)."""

    n: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: str | Iterable[str] | None
    stop_token_ids: Iterable[int] | None
    ignore_eos: bool
    min_tokens: int
    include_stop_str_in_output: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int | None
    prompt_logprobs: int | None
    pooling: Pooling | str | None
    guided: GuidedSpec | None
    logit_bias: dict[int, float]
    allowed_token_ids: list[int] | None
    bad_words: list[str] | None
    use_beam_search: bool
    length_penalty: float
    early_stopping: bool | str


def _as_list(name: str, value: Any) -> list[Any]:
    """``value`` as a fresh list; one string (a single stop string) becomes a 1-item list."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, bytes) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a list, got {value!r}")
    return list(value)


def _as_bias(name: str, value: Any) -> dict[int, float]:
    """`logit_bias` as a fresh dict of int ids; JSON's string keys ("50256") become ints."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a map of token id to bias, got {value!r}")
    bias = {}
    for key, weight in value.items():
        if isinstance(key, str):
            if not key.strip().isdigit():
                raise ValueError(f"{name} keys must be token ids, got {key!r}")
            key = int(key)
        bias[key] = weight
    return bias


def _check_token_id(name: str, value: Any) -> None:
    _check_int(name, value)
    if value < 0:
        raise ValueError(f"{name} must be a token id >= 0, got {value}")


def _check_int(name: str, value: Any) -> None:
    # bool is a subclass of int, but True as a token count is always a caller's mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")


def _check_float(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
