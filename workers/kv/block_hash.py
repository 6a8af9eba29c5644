"""Chained block hashes shared by the router and every worker.

A block's hash covers its parent's hash, its token ids and extra keys (model id, cache salt), so
equal hashes mean equal prefixes up to and including the block. SHA-256 over a canonical binary
encoding makes the value identical across processes and machines (Python's `hash` is salted).

The encoding, in order (integers little-endian; a change of it must change `_DOMAIN`):

    b"pagedserve.block.v1"
    parent: 32 zero bytes for the first block, else b"\x01" + the parent's 32-byte digest
    u32 number of tokens, then each token id as i64
    u32 number of extra keys, then per key: u32 byte length + its UTF-8 bytes
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

from pagedserve.workers.protocol.blocks import BlockHash

_DOMAIN = b"pagedserve.block.v1"
_NO_PARENT = b"\x00" * 32


# The third extra key of a request on a LoRA adapter: this prefix, then the adapter's key.
LORA_KEY_PREFIX = "lora:"


def cache_key(model: str, cache_salt: str | None, lora_key: str | None = None) -> tuple[str, ...]:
    """The extra keys every process hashes a request's blocks with: the model id, then the
    request's cache salt when it has one. An empty salt is no salt (a gRPC request without one
    carries ""): the router, which routes by these hashes, and the worker, which caches under
    them, must build the same key for every request, or a prefix hit is never seen.

    A request on a LoRA adapter (``lora_key``: `LoraAdapter.key`, its name and a digest of its
    files) has three keys, ``(model, salt or "", "lora:" + lora_key)``: the adapter changes
    every layer's K and V, so its blocks never match the base model's (one or two keys; the
    count is hashed) nor another adapter's. The keys travel with every block and handoff, so
    a moved or replayed request keeps its adapter (`lora_key_of`)."""
    if lora_key:
        return (model, cache_salt or "", LORA_KEY_PREFIX + lora_key)
    return (model, cache_salt) if cache_salt else (model,)


def lora_key_of(extra_keys: Sequence[str]) -> str | None:
    """The LoRA adapter key ``cache_key`` put in ``extra_keys`` (None: the base model)."""
    if len(extra_keys) == 3 and extra_keys[2].startswith(LORA_KEY_PREFIX):
        return extra_keys[2][len(LORA_KEY_PREFIX) :]
    return None


def _encode_extra_keys(extra_keys: Sequence[str]) -> bytes:
    parts = [struct.pack("<I", len(extra_keys))]
    for key in extra_keys:
        raw = key.encode("utf-8")
        parts.append(struct.pack("<I", len(raw)))
        parts.append(raw)
    return b"".join(parts)


def block_hash(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()
) -> BlockHash:
    """SHA-256 of (parent hash, token ids, extra keys) in a canonical encoding.

    Args:
        parent: hash of the previous block of the sequence, or None for the first block.
        token_ids: the block's token ids (a full block).
        extra_keys: strings that must match for two blocks to share KV (model id, cache salt).

    Returns:
        The 32-byte digest.
    """
    digest = hashlib.sha256(_DOMAIN)
    digest.update(_NO_PARENT if parent is None else b"\x01" + parent)
    tokens = array("q", token_ids)
    if sys.byteorder == "big":
        tokens.byteswap()  # the encoding is little-endian on every machine
    digest.update(struct.pack("<I", len(tokens)))
    digest.update(tokens.tobytes())
    digest.update(_encode_extra_keys(extra_keys))
    return digest.digest()


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, extra_keys: Sequence[str] = ()
) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids` (the partial tail is not hashed).

    The same digests as `block_hash` block by block (the router hashes every prompt, so this
    is on the request path): the parts every block shares (domain, length, extra keys) are
    encoded once, and the token ids once for the whole prompt.
    """
    num_blocks = len(token_ids) // block_size
    if num_blocks == 0:
        return []
    tokens = array("q", token_ids[: num_blocks * block_size])
    if sys.byteorder == "big":
        tokens.byteswap()
    raw = memoryview(tokens.tobytes())
    block_bytes = block_size * tokens.itemsize
    length = struct.pack("<I", block_size)
    extra = _encode_extra_keys(extra_keys)
    domain = hashlib.sha256(_DOMAIN)
    hashes: list[BlockHash] = []
    parent_part = _NO_PARENT
    for i in range(num_blocks):
        digest = domain.copy()
        digest.update(parent_part)
        digest.update(length)
        digest.update(raw[i * block_bytes : (i + 1) * block_bytes])
        digest.update(extra)
        parent = digest.digest()
        hashes.append(parent)
        parent_part = b"\x01" + parent
    return hashes
