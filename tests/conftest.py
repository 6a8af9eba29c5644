"""Fixtures every test folder shares: the real model, loaded once per session."""

import pytest
from support.engine import ReferenceModel, load
from support.real_model import SMOLLM2


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (float32) and HF's reference copy of it."""
    loaded = load(SMOLLM2)
    return loaded, ReferenceModel(loaded)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's BPE tokenizer alone (no weights loaded)."""
    from pagedserve.workers.tokenizer import load_tokenizer

    return load_tokenizer(SMOLLM2)
