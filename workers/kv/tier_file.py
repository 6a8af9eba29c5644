"""One disk-tier file: a self-describing KV block, validated before it is trusted.

    b"PSKVBLK1"                       magic and format version
    u32 header length, little-endian
    header: UTF-8 JSON               {"block_hash", "parent_hash", "token_ids", "extra_keys",
                                      "layout", "payload_bytes", "payload_crc32"}
    payload                          the block's KV, [L, 2, B, Hkv, D] in `layout.dtype`, C order

A file is named after its block hash (`<hex>.kvb`). `read_header` checks everything but the
payload's checksum (cheap enough to run over a whole directory at start); `read_block` checks the
checksum too, when the block is loaded. Any failure raises `CorruptBlockFile` naming the problem.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from pagedserve.workers.kv.block_hash import block_hash
from pagedserve.workers.protocol.blocks import BlockHash, BlockKey

MAGIC = b"PSKVBLK1"
SUFFIX = ".kvb"
_LENGTH = struct.Struct("<I")
_MAX_HEADER_BYTES = 16 * 1024 * 1024


class CorruptBlockFile(ValueError):
    """A disk-tier file that cannot be trusted (truncated, foreign, or not what it claims)."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What a block's KV must look like to be loaded into this engine's pool."""

    model: str  # the model's name (with the weight seed of a random test model)
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True, slots=True)
class BlockHeader:
    block_hash: BlockHash
    key: BlockKey
    payload_offset: int
    payload_bytes: int
    payload_crc32: int


def file_name(digest: BlockHash) -> str:
    return digest.hex() + SUFFIX


def encode_block(digest: BlockHash, key: BlockKey, kv: Tensor, layout: KVLayout) -> bytes:
    """The whole file for one block (`kv` is ``[L, 2, B, Hkv, D]`` on the CPU)."""
    if tuple(kv.shape) != layout.block_shape:
        raise ValueError(f"block KV shape {tuple(kv.shape)} != {layout.block_shape}")
    payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
    header = json.dumps(
        {
            "block_hash": digest.hex(),
            "parent_hash": None if key.parent_hash is None else key.parent_hash.hex(),
            "token_ids": list(key.token_ids),
            "extra_keys": list(key.extra_keys),
            "layout": asdict(layout),
            "payload_bytes": len(payload),
            "payload_crc32": zlib.crc32(payload),
        }
    ).encode()
    return MAGIC + _LENGTH.pack(len(header)) + header + payload


def read_header(path: Path, layout: KVLayout) -> BlockHeader:
    """Parse and check a file's header against `layout`, its name and its size."""
    try:
        with path.open("rb") as file:
            prefix = file.read(len(MAGIC) + _LENGTH.size)
            if len(prefix) < len(MAGIC) + _LENGTH.size or prefix[: len(MAGIC)] != MAGIC:
                raise CorruptBlockFile(f"{path.name}: not a KV block file (bad magic)")
            (length,) = _LENGTH.unpack(prefix[len(MAGIC) :])
            if length > _MAX_HEADER_BYTES:
                raise CorruptBlockFile(f"{path.name}: header length {length} is implausible")
            raw = file.read(length)
        size = os.path.getsize(path)
        fields = json.loads(raw.decode())
        digest = bytes.fromhex(fields["block_hash"])
        parent = fields["parent_hash"]
        key = BlockKey(
            None if parent is None else bytes.fromhex(parent),
            tuple(int(t) for t in fields["token_ids"]),
            tuple(str(k) for k in fields["extra_keys"]),
        )
        stored_layout = KVLayout(**fields["layout"])
        payload_bytes = int(fields["payload_bytes"])
        crc = int(fields["payload_crc32"])
    except CorruptBlockFile:
        raise
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        raise CorruptBlockFile(f"{path.name}: unreadable header ({error})") from error
    if stored_layout != layout:
        raise CorruptBlockFile(f"{path.name}: layout {stored_layout} is not this pool's {layout}")
    if block_hash(key.parent_hash, key.token_ids, key.extra_keys) != digest:
        raise CorruptBlockFile(f"{path.name}: its key does not hash to its block hash")
    if path.name != file_name(digest):
        raise CorruptBlockFile(f"{path.name}: named after another block")
    offset = len(MAGIC) + _LENGTH.size + length
    expected = _payload_bytes(layout)
    if payload_bytes != expected or size != offset + payload_bytes:
        raise CorruptBlockFile(
            f"{path.name}: {size} bytes on disk, header says {offset} + {payload_bytes} "
            f"(a block is {expected})"
        )
    return BlockHeader(digest, key, offset, payload_bytes, crc)


def read_block(path: Path, header: BlockHeader, layout: KVLayout) -> Tensor:
    """The block's KV, after checking its payload against the header's checksum."""
    try:
        with path.open("rb") as file:
            file.seek(header.payload_offset)
            payload = file.read(header.payload_bytes)
    except OSError as error:
        raise CorruptBlockFile(f"{path.name}: unreadable ({error})") from error
    if len(payload) != header.payload_bytes or zlib.crc32(payload) != header.payload_crc32:
        raise CorruptBlockFile(f"{path.name}: payload checksum mismatch")
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return flat.view(layout.torch_dtype).reshape(layout.block_shape)


def _payload_bytes(layout: KVLayout) -> int:
    count = 1
    for dim in layout.block_shape:
        count *= dim
    return count * torch.empty((), dtype=layout.torch_dtype).element_size()
