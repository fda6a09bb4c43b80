"""The page hash chain of protos/cache.proto: definition, whole-prompt == page by page, encoding."""

from __future__ import annotations

import itertools
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st
from xxhash import xxh3_64_intdigest

from cache_service import native
from cache_service import page_hash as page_hash_module
from cache_service.page_hash import iter_page_hashes, namespace_seed, page_hash, page_hashes
from common.token_bytes import decode_tokens, encode_tokens, max_token, unpack_tokens
from examples import kv_mirror
from tests.native_required import SKIP_PREFIX

token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=80)
namespaces = st.sampled_from(["", "tenant-a", "ténant-ü", "x" * 40])


def documented_chain(parent: int, namespace: str, tokens: list[int], page_size: int) -> list[int]:
    """The chain exactly as protos/cache.proto writes it (BlockStored)."""
    ns_seed = xxh3_64_intdigest(namespace.encode("utf-8"), 0)
    out, h = [], parent
    for i in range(len(tokens) // page_size):
        page = b"".join(t.to_bytes(4, "little") for t in tokens[i * page_size : (i + 1) * page_size])
        h = xxh3_64_intdigest(page, h ^ ns_seed)
        out.append(h)
    return out


@given(token_lists, namespaces, st.sampled_from([1, 2, 4, 16]), st.integers(0, 2**64 - 1))
def test_whole_prompt_equals_page_by_page_and_the_documented_chain(
    tokens: list[int], namespace: str, page_size: int, parent: int
) -> None:
    whole = page_hashes(parent, namespace, tokens, page_size)
    assert whole == documented_chain(parent, namespace, tokens, page_size)
    assert whole == page_hashes(parent, namespace, encode_tokens(tokens), page_size)  # bytes in
    assert whole == kv_mirror.page_hashes(parent, namespace, tokens, page_size)  # the example agrees
    h, one_by_one = parent, []
    for i in range(len(whole)):
        h = page_hash(h, namespace, tokens[i * page_size : (i + 1) * page_size])
        one_by_one.append(h)
    assert one_by_one == whole
    # Split anywhere: the tail continues from the head's last hash.
    cut = len(whole) // 2
    head = page_hashes(parent, namespace, tokens[: cut * page_size], page_size)
    tail = page_hashes(head[-1] if head else parent, namespace, tokens[cut * page_size :], page_size)
    assert head + tail == whole


def test_known_values_pin_the_chain() -> None:
    # Changing these breaks every external consumer (routers, kv_mirror): bump deliberately only.
    assert namespace_seed("") == xxh3_64_intdigest(b"")
    hashes = page_hashes(0, "", [1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert hashes == documented_chain(0, "", [1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(set(hashes)) == 2 and all(0 <= h < 2**64 for h in hashes)
    assert page_hashes(0, "a", [1, 2, 3, 4], 4) != page_hashes(0, "b", [1, 2, 3, 4], 4)


@given(token_lists)
def test_encoding_round_trips(tokens: list[int]) -> None:
    raw = encode_tokens(tokens)
    assert len(raw) == 4 * len(tokens) and decode_tokens(raw) == tokens
    assert encode_tokens(tuple(tokens)) == raw and encode_tokens(raw) is raw


@given(token_lists)
def test_packed_tokens_unpack_to_the_same_ids(tokens: list[int]) -> None:
    """Admit.packed_token_ids: little-endian uint32 per id, read into an array('I') that encodes
    back to the same bytes and has the same largest id."""
    raw = b"".join(t.to_bytes(4, "little") for t in tokens)  # the wire format, spelled out
    assert encode_tokens(tokens) == raw
    unpacked = unpack_tokens(raw)
    assert isinstance(unpacked, array) and unpacked.tolist() == tokens
    assert encode_tokens(unpacked) == raw and page_hashes(0, "", unpacked, 4) == page_hashes(0, "", tokens, 4)
    if tokens:
        assert max_token(unpacked) == max_token(tokens) == max(tokens)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 4099])
def test_unpack_refuses_a_partial_token(size: int) -> None:
    with pytest.raises(ValueError, match="not a whole number"):
        unpack_tokens(bytes(size))


@pytest.mark.parametrize("core", ["c", "python"])
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=700), namespace=namespaces,
       page_size=st.sampled_from([1, 3, 16]), parent=st.integers(0, 2**64 - 1), stop=st.integers(0, 300))
def test_both_cores_give_the_documented_chain_whole_and_lazily(core, tokens, namespace, page_size, parent, stop) -> None:
    """The C core (cache_service/native/hash_ops.c) and the Python loop: the same hashes, whole
    and page by page (the lazy walk hashes in growing runs; taking only the first `stop`)."""
    if core == "c" and native.hash_ops() is None:
        pytest.skip(f"{SKIP_PREFIX}: the cache manager's C core ({native.unavailable_reason()})")
    expected = documented_chain(parent, namespace, tokens, page_size)
    saved = page_hash_module._ops
    page_hash_module._ops = native.hash_ops() if core == "c" else None
    try:
        raw = encode_tokens(tokens)
        assert page_hashes(parent, namespace, tokens, page_size) == expected
        assert list(iter_page_hashes(parent, namespace, raw, page_size)) == expected
        assert list(itertools.islice(iter_page_hashes(parent, namespace, raw, page_size), stop)) == expected[:stop]
    finally:
        page_hash_module._ops = saved
