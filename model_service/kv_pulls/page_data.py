"""Pages of the KV pool as KvTransfer sends them (kv_transfer.proto PageData).

A pull's pages travel in groups of consecutive pages; per group, one message per layer holding
K then V of those pages exactly as the tensors hold them ([pages, block_size, kv_heads,
head_dim], the pool's dtype), with an XXH3-64 checksum of the bytes. A group counts once all its
layers arrived and checked; a pull's result is the leading pages of its complete groups.

A pull moves tens of megabytes, so the messages are built and read without protobuf copying the
payload: `encode` writes the wire format itself (the small fields through protobuf, the payload
appended as field 4 in one join of the tensors' buffers), `decode` reads the small fields and
hands back a view of the payload inside the received bytes. Both are plain proto3 wire format:
any protobuf library reads and writes these messages.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import xxhash

from model_service.kv_cache import KVCache
from model_service.tiers.host_tier import HostTier
from protos import kv_transfer_pb2

MAX_MESSAGE_BYTES = 1 << 20  # per PageData: well under gRPC's default 4 MiB receive limit
_DATA_TAG = b"\x22"  # field 4, length-delimited
# The payload is read in place from the received (read-only) bytes and copied into the pool:
# torch's warning about writing through such a tensor does not apply.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


class BadMessage(ValueError):
    pass


def page_layer_bytes(kv: KVCache) -> int:
    """Bytes of one page's K and V in one layer."""
    spec = kv.spec
    return 2 * spec.block_size * spec.num_kv_heads * spec.head_dim * kv.k[0].element_size()


def group_pages(kv: KVCache) -> int:
    """Pages per message (at least one)."""
    return max(1, MAX_MESSAGE_BYTES // page_layer_bytes(kv))


Buffers = list[np.ndarray]  # a payload's pieces, in order: contiguous uint8 arrays


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


def read_layer(kv: KVCache, layer: int, blocks: list[int]) -> tuple[Buffers, Buffers]:
    """K and V of `blocks` in `layer`: on the CPU views of the pool's own pages (no copy: the
    pages are pinned, nothing writes them), elsewhere one copy to the host."""
    k, v = kv.k[layer], kv.v[layer]
    if k.device.type != "cpu":
        index = torch.tensor(blocks, dtype=torch.int64, device=k.device)
        return [_bytes_of(k.index_select(0, index).cpu())], [_bytes_of(v.index_select(0, index).cpu())]
    k_pages, v_pages = k.view(k.shape[0], -1).view(torch.uint8).numpy(), v.view(v.shape[0], -1).view(torch.uint8).numpy()
    return [k_pages[b] for b in blocks], [v_pages[b] for b in blocks]


def read_host_layer(host: HostTier, layer: int, slots: list[int]) -> tuple[Buffers, Buffers]:
    """`read_layer` of host-tier slots (a slot is [num_layers, 2, ...]: K and V of every layer)."""
    data = host.data
    return [_bytes_of(data[s, layer, 0]) for s in slots], [_bytes_of(data[s, layer, 1]) for s in slots]


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode(first_page: int, num_pages: int, layer: int, k: Buffers, v: Buffers) -> bytes:
    """A serialized PageData of K then V, its checksum over both: one copy of the payload."""
    digest = xxhash.xxh3_64()
    size = 0
    for piece in (*k, *v):
        digest.update(piece)
        size += piece.nbytes
    head = kv_transfer_pb2.PageData(first_page=first_page, num_pages=num_pages, layer=layer,
                                    checksum=digest.intdigest()).SerializeToString()
    return b"".join((head, _DATA_TAG, _varint(size), *k, *v))


def decode(raw: bytes) -> tuple[int, int, int, int, memoryview]:
    """(first_page, num_pages, layer, checksum, data) of a serialized PageData, `data` a view into
    `raw`; BadMessage when it is not one."""
    view = memoryview(raw)
    fields = {1: 0, 2: 0, 3: 0, 5: 0}
    data = view[0:0]
    pos, end = 0, len(raw)
    try:
        while pos < end:
            key, pos = _read_varint(raw, pos)
            number, wire = key >> 3, key & 7
            if wire == 0:
                value, pos = _read_varint(raw, pos)
                if number in fields:
                    fields[number] = value
            elif wire == 2:
                length, pos = _read_varint(raw, pos)
                if pos + length > end:
                    raise BadMessage("a field runs past the end of the message")
                if number == 4:
                    data = view[pos:pos + length]
                pos += length
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            else:
                raise BadMessage(f"wire type {wire} of field {number}")
    except IndexError:
        raise BadMessage("the message ends inside a field") from None
    if pos != end:
        raise BadMessage("the message ends inside a field")
    return fields[1], fields[2], fields[3], fields[5], data


def _read_varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise BadMessage("a varint longer than 64 bits")


def checksum(data: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


def write_layer(kv: KVCache, layer: int, blocks: torch.Tensor, data: memoryview) -> None:
    """Writes K then V (as `encode` sent them) into `blocks` of `layer`; ValueError when `data` is
    not exactly that many pages."""
    k_cache, v_cache = kv.k[layer], kv.v[layer]
    n = blocks.numel()
    expected = n * page_layer_bytes(kv)
    if len(data) != expected:
        raise ValueError(f"layer {layer}: {len(data)} bytes for {n} pages, expected {expected}")
    raw = torch.frombuffer(data, dtype=torch.uint8).view(k_cache.dtype)
    shape = (n, *k_cache.shape[1:])
    half = raw.numel() // 2
    device = k_cache.device
    k_cache.index_copy_(0, blocks, raw[:half].view(shape).to(device))
    v_cache.index_copy_(0, blocks, raw[half:].view(shape).to(device))
