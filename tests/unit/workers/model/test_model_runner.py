"""ModelRunner: paged-attention logits equal HF's own full-sequence forward, through the fused
decoder (Llama, Mistral, Qwen2; its projections through torch's linear or oneDNN's over packed
weights) and through HF's own modules with the attention swapped.

Each scenario runs a packed batch through chunked prefill, a mixed prefill+decode step and
decode-only steps, with block tables drawn from a shuffled pool, and checks the logits of every
new token against HF's plain forward (sdpa, no cache) over the whole sequence so far.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field

import pytest
import torch
from transformers import (
    AttentionInterface,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from pagedserve.kernels import get_kernel_ops
from pagedserve.workers.kv.cache import KVCache
from pagedserve.workers.model.attention_metadata import AttentionMetadata
from pagedserve.workers.model.loader import LoadedModel, load_model
from pagedserve.workers.model.runner import PAGED_ATTENTION_NAME, ModelRunner
from pagedserve.workers.model.runner import paged_attention_forward as real_attention
from pagedserve.workers.model.tiny_llama import TINY_LLAMA_NAME

OPS = get_kernel_ops("torch")
NUM_BLOCKS = 48
SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _small_checkpoint(tmp_path_factory, family: str) -> str:
    path = str(tmp_path_factory.mktemp(family))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if family == "qwen2":
            model = Qwen2ForCausalLM(Qwen2Config(**SMALL))
        else:
            model = MistralForCausalLM(MistralConfig(**SMALL, sliding_window=4096))
        for param in model.parameters():  # HF's 0.02 init makes near-uniform logits
            param.data.normal_(0.0, 0.3)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["tiny-llama", "qwen2", "mistral"])
def model_path(request, tmp_path_factory) -> str:
    if request.param == "tiny-llama":
        return "tiny-llama"
    return _small_checkpoint(tmp_path_factory, request.param)


@dataclass
class _Seq:
    tokens: list[int]
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)


class _PagedHarness:
    """A stand-in for the block manager and engine: tables, slots, packing, reference logits."""

    def __init__(
        self,
        loaded: LoadedModel,
        block_size: int,
        seed: int,
        fuse: bool = True,
        linear_backend: str = "torch",
    ) -> None:
        self.reference = copy.deepcopy(loaded.model)  # before the runner swaps its attention
        self.block_size = block_size
        self.kv_cache = KVCache(
            num_layers=loaded.num_layers,
            num_blocks=NUM_BLOCKS,
            block_size=block_size,
            num_kv_heads=loaded.num_kv_heads,
            head_dim=loaded.head_dim,
            dtype=loaded.dtype,
            device="cpu",
            ops=OPS,
        )
        self.runner = ModelRunner(
            loaded, self.kv_cache, OPS, fuse=fuse, linear_backend=linear_backend
        )
        assert (self.runner.fused is not None) == fuse
        self.free_blocks = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free_blocks)
        self.seqs: dict[str, _Seq] = {}

    def step(self, num_new: dict[str, int]) -> None:
        """Run ``num_new[seq]`` tokens of each sequence; check every row; extend finished ones."""
        chunks = [(name, self.seqs[name], n) for name, n in num_new.items()]
        input_ids, positions, metadata = self._pack(chunks)
        logits = self.runner.execute(
            input_ids, positions, metadata, torch.arange(len(input_ids), dtype=torch.int64)
        )
        row = 0
        for _, seq, n in chunks:
            start, end = seq.num_computed, seq.num_computed + n
            expected = self._reference_logits(seq.tokens[:end])[start:end]
            torch.testing.assert_close(logits[row : row + n], expected, atol=1e-4, rtol=1e-4)
            seq.num_computed = end
            if end == len(seq.tokens):  # caught up: greedy-sample the next token
                seq.tokens.append(int(logits[row + n - 1].argmax()))
            row += n

    def _pack(self, chunks: list[tuple[str, _Seq, int]]):
        ids, positions, slots, tables, starts, lens = [], [], [], [], [0], []
        for _, seq, n in chunks:
            start, end = seq.num_computed, seq.num_computed + n
            while len(seq.blocks) * self.block_size < end:
                seq.blocks.append(self.free_blocks.pop())
            ids += seq.tokens[start:end]
            positions += range(start, end)
            slots += [
                seq.blocks[p // self.block_size] * self.block_size + p % self.block_size
                for p in range(start, end)
            ]
            tables.append(seq.blocks)
            starts.append(starts[-1] + n)
            lens.append(end)
        width = max(len(t) for t in tables)
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32
            ),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            max_query_len=max(n for *_, n in chunks),
        )
        as_long = lambda values: torch.tensor(values, dtype=torch.int64)
        return as_long(ids), as_long(positions), metadata

    @torch.no_grad()
    def _reference_logits(self, tokens: list[int]) -> torch.Tensor:
        return self.reference(torch.tensor([tokens]), use_cache=False).logits[0].float()


def _prompt(rng: random.Random, vocab: int, length: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


@pytest.mark.parametrize(
    "fuse, linear_backend",
    [(True, "torch"), (True, "onednn"), (False, "torch")],
    ids=["fused", "fused-onednn", "hf-modules"],
)
@pytest.mark.parametrize("block_size", [8, 16])
def test_logits_match_hf_through_chunked_prefill_and_decode(
    model_path: str, block_size: int, fuse: bool, linear_backend: str
):
    loaded = load_model(model_path)
    harness = _PagedHarness(
        loaded, block_size, seed=block_size, fuse=fuse, linear_backend=linear_backend
    )
    rng = random.Random(block_size)
    for name, length in (("a", 37), ("b", 21), ("c", 5)):
        harness.seqs[name] = _Seq(_prompt(rng, loaded.vocab_size, length))
    harness.step({"a": 20, "b": 21, "c": 5})  # a: first prefill chunk
    harness.step({"b": 1, "a": 17, "c": 1})  # a: second chunk, mixed with decodes
    for _ in range(5):  # decode only, crossing block boundaries
        harness.step({"a": 1, "b": 1, "c": 1})
    harness.seqs["d"] = _Seq(_prompt(rng, loaded.vocab_size, 3))
    harness.step({"c": 1, "d": 3, "a": 1})  # a newcomer while others decode
    assert len(harness.free_blocks) < NUM_BLOCKS - 6


def test_prefix_blocks_shared_between_sequences():
    """A sequence whose first block is another's (a prefix-cache hit) computes only its suffix."""
    loaded = load_model(TINY_LLAMA_NAME)
    harness = _PagedHarness(loaded, block_size=8, seed=1)
    rng = random.Random(1)
    prefix = _prompt(rng, loaded.vocab_size, 8)
    harness.seqs["a"] = _Seq(prefix + _prompt(rng, loaded.vocab_size, 5))
    harness.step({"a": 13})
    shared = _Seq(prefix + _prompt(rng, loaded.vocab_size, 4), num_computed=8)
    shared.blocks = harness.seqs["a"].blocks[:1]
    harness.seqs["b"] = shared
    harness.step({"b": 4, "a": 1})
    harness.step({"b": 1, "a": 1})


def test_hf_modules_build_no_mask_and_compute_only_wanted_logits():
    loaded = load_model(TINY_LLAMA_NAME)
    harness = _PagedHarness(loaded, block_size=8, seed=2, fuse=False)
    masks, lm_head_rows = [], []

    def spy(module, query, key, value, attention_mask, **kwargs):
        masks.append(attention_mask)
        return real_attention(module, query, key, value, attention_mask, **kwargs)

    hook = loaded.model.lm_head.register_forward_hook(
        lambda _m, args, _out: lm_head_rows.append(args[0].shape[1])
    )
    AttentionInterface.register(PAGED_ATTENTION_NAME, spy)
    try:
        harness.seqs["a"] = _Seq(list(range(30)))
        harness.seqs["b"] = _Seq(list(range(40, 52)))
        input_ids, positions, metadata = harness._pack(
            [("a", harness.seqs["a"], 30), ("b", harness.seqs["b"], 12)]
        )
        logits = harness.runner.execute(
            input_ids, positions, metadata, torch.tensor([29, 41], dtype=torch.int64)
        )
    finally:
        AttentionInterface.register(PAGED_ATTENTION_NAME, real_attention)
        hook.remove()
    assert masks == [None] * loaded.num_layers
    assert lm_head_rows == [2]
    assert logits.shape == (2, loaded.vocab_size) and logits.dtype == torch.float32


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "hf-modules"])
def test_pooled_hidden_states_are_hf_s_last_hidden_state(fuse: bool):
    """The rows an embedding pools are the final norm's output, as HF's `last_hidden_state`,
    beside logits of other rows in the same step."""
    loaded = load_model(TINY_LLAMA_NAME)
    harness = _PagedHarness(loaded, block_size=8, seed=4, fuse=fuse)
    a, b = list(range(60, 90)), list(range(40, 52))
    harness.seqs["a"], harness.seqs["b"] = _Seq(a), _Seq(b)
    input_ids, positions, metadata = harness._pack(
        [("a", harness.seqs["a"], 30), ("b", harness.seqs["b"], 12)]
    )
    as_long = lambda values: torch.tensor(values, dtype=torch.int64)
    logits, hidden = harness.runner.execute_pooling(
        input_ids, positions, metadata, as_long([41]), as_long([3, 29, 30, 41])
    )
    with torch.no_grad():
        last_a = harness.reference.model(torch.tensor([a])).last_hidden_state[0]
        last_b = harness.reference.model(torch.tensor([b])).last_hidden_state[0]
    expected = torch.stack([last_a[3], last_a[29], last_b[0], last_b[11]])
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[0], harness._reference_logits(b)[-1], atol=1e-4, rtol=1e-4)
    _, none = harness.runner.execute_pooling(input_ids, positions, metadata, as_long([1]), None)
    assert none is None


def test_runner_rejects_a_pool_that_does_not_fit_the_model():
    loaded = load_model(TINY_LLAMA_NAME)
    wrong = KVCache(
        num_layers=loaded.num_layers,
        num_blocks=4,
        block_size=8,
        num_kv_heads=loaded.num_kv_heads,
        head_dim=16,
        dtype=loaded.dtype,
        device="cpu",
        ops=OPS,
    )
    with pytest.raises(ValueError, match="head_dim"):
        ModelRunner(loaded, wrong, OPS)


def test_execute_rejects_bad_inputs():
    loaded = load_model(TINY_LLAMA_NAME)
    harness = _PagedHarness(loaded, block_size=8, seed=3)
    harness.seqs["a"] = _Seq([1, 2, 3])
    input_ids, positions, metadata = harness._pack([("a", harness.seqs["a"], 3)])
    wanted = torch.tensor([2], dtype=torch.int64)
    with pytest.raises(ValueError, match="positions"):
        harness.runner.execute(input_ids, positions.int(), metadata, wanted)
    with pytest.raises(ValueError, match="slot_mapping has 2 slots"):
        metadata.slot_mapping = metadata.slot_mapping[:2]
        harness.runner.execute(input_ids, positions, metadata, wanted)


def test_fused_decoder_computes_only_wanted_logits_and_shares_the_weights(monkeypatch):
    loaded = load_model(TINY_LLAMA_NAME)
    before = {name: p.detach().clone() for name, p in loaded.model.named_parameters()}
    harness = _PagedHarness(loaded, block_size=8, seed=2)
    fused = harness.runner.fused
    lm_head_rows = []
    original_linear = torch.nn.functional.linear

    def spy_linear(x, weight, bias=None):
        if weight is fused.lm_head.weight:
            lm_head_rows.append(x.shape[0])
        return original_linear(x, weight, bias)

    harness.seqs["a"] = _Seq(list(range(30)))
    harness.seqs["b"] = _Seq(list(range(40, 52)))
    input_ids, positions, metadata = harness._pack(
        [("a", harness.seqs["a"], 30), ("b", harness.seqs["b"], 12)]
    )
    monkeypatch.setattr(torch.nn.functional, "linear", spy_linear)
    logits = harness.runner.execute(
        input_ids, positions, metadata, torch.tensor([29, 41], dtype=torch.int64)
    )
    monkeypatch.undo()
    assert lm_head_rows == [2]
    torch.testing.assert_close(logits[1], harness._reference_logits(list(range(40, 52)))[-1])
    # The HF linears are views of the fused weights (no second copy), with unchanged values.
    for layer, fused_layer in zip(loaded.model.model.layers, fused.layers, strict=True):
        attention = layer.self_attn
        storage = fused_layer.qkv.weight.untyped_storage().data_ptr()
        for linear in (attention.q_proj, attention.k_proj, attention.v_proj):
            assert linear.weight.untyped_storage().data_ptr() == storage
    for name, param in loaded.model.named_parameters():
        assert torch.equal(param, before[name]), name


def test_a_model_the_fused_decoder_does_not_know_keeps_hf_modules(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from pagedserve.workers.model.fused_decoder import unfusable_reason

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=16))
        for param in model.parameters():
            param.data.normal_(0.0, 0.3)
    assert "qwen3" in unfusable_reason(model)
    model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    harness = _PagedHarness(loaded, block_size=8, seed=4, fuse=False)
    assert ModelRunner(loaded, harness.kv_cache, OPS).fused is None
    rng = random.Random(4)
    harness.seqs["a"] = _Seq(_prompt(rng, loaded.vocab_size, 11))
    harness.step({"a": 11})
    harness.step({"a": 1})
