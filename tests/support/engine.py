"""Shared fixtures for engine tests: models loaded once, and HF's own greedy reference."""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from pagedserve.workers.engine.engine import Engine
from pagedserve.workers.engine.outputs import OutputBuilder, RequestDelta, RequestOutput
from pagedserve.workers.kv.checks import assert_no_leaks
from pagedserve.workers.model.loader import LoadedModel, load_model
from pagedserve.workers.offline.llm import LLM


class ReferenceModel:
    """A copy of the model with HF's own attention and cache, for greedy equivalence checks."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.model = copy.deepcopy(loaded.model)
        self._memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_tokens)
        if key not in self._memo:
            cache = DynamicCache()
            ids = torch.tensor([prompt_ids])
            out: list[int] = []
            for _ in range(max_tokens):
                logits = self.model(input_ids=ids, cache=cache, use_cache=True).logits
                token = int(logits[0, -1].argmax())
                out.append(token)
                ids = torch.tensor([[token]])
            self._memo[key] = out
        return self._memo[key]


def build_qwen2_checkpoint(path) -> None:
    """A small random Qwen2-architecture checkpoint written as a real HF directory."""
    torch.manual_seed(1234)
    config = Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.3)
    model.save_pretrained(path)


def load(model: str) -> LoadedModel:
    return load_model(model)


def finish_clean(llm: LLM) -> None:
    """Every test that runs requests ends here: nothing in flight, no block leaked."""
    assert not llm.engine.has_unfinished_requests()
    assert_no_leaks(llm.engine.kv)


def record_plans(engine: Engine) -> list:
    """Every plan the engine's scheduler makes from now on, in order (the list fills as the
    engine steps)."""
    plans = []
    schedule = engine.scheduler.schedule

    def recording():
        plans.append(schedule())
        return plans[-1]

    engine.scheduler.schedule = recording
    return plans


class Stepper:
    """Steps an engine by hand and adds its deltas up (as `LLM.generate` does) into whole
    outputs: `outputs[request_id]` once a request finished."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.outputs: dict[str, RequestOutput] = {}
        self._builders: dict[str, OutputBuilder] = {}

    def step(self) -> list[RequestDelta]:
        deltas = self.engine.step()
        self.add(deltas)
        return deltas

    def add(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            builder = self._builders.setdefault(delta.request_id, OutputBuilder(delta.request_id))
            builder.add(delta)
            if delta.finished:
                self.outputs[delta.request_id] = self._builders.pop(delta.request_id).build()

    def run_to_end(self) -> dict[str, RequestOutput]:
        while self.engine.has_unfinished_requests():
            self.step()
        return self.outputs
