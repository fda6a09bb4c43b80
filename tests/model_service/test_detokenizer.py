"""Tests for model_service.detokenizer with the bundled SmolLM2 tokenizer (byte-level BPE)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model_service.detokenizer import DetokenizerStep, IncrementalDetokenizer
from tests.model_service.tokenizer_fixture import load_smollm2_tokenizer

REPLACEMENT = "\ufffd"
PROMPT = "Write a short answer:"

REAL_TEXTS = [
    "Hello world! This is a plain ASCII sentence.",
    "  two leading spaces,\ttabs\tand\nnew lines\n\n",
    " Emojis 🎉🚀 and a family 👨\u200d👩\u200d👧 with flags 🇫🇷.",
    "CJK: 世界你好, こんにちは, 안녕하세요; Greek αβγ; Cyrillic привет.",
    "Accents: café, naïve, e\u0301t\u00e9 (combining), Ångström, ß.",
    "Math: ∑ x² ≤ ∞ → λ; arrows ⇒; currency €£¥.",
    "def f(x):\n    return {'k': [x, x ** 2]}  # code 🐍\n",
]


@pytest.fixture(scope="session")
def tokenizer(request: pytest.FixtureRequest):
    cache = getattr(request.config, "cache", None)
    return load_smollm2_tokenizer(cache.mkdir("smollm2-tokenizer") if cache is not None else None)


@pytest.fixture(scope="session")
def token_pool(tokenizer) -> list[int]:
    """Ids that make multi-byte splits likely: single-byte tokens, fragments of emoji/CJK text,
    special tokens, plus some ordinary word tokens."""
    byte_tokens = [i for i in range(len(tokenizer)) if len(tokenizer.convert_ids_to_tokens(i)) == 1]
    fragments = {i for text in REAL_TEXTS for i in tokenizer.encode(text, add_special_tokens=False)}
    return sorted(set(byte_tokens) | fragments | {0, 1, 2})


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(tokenizer, output_ids: list[int], prompt_ids: list[int] | None = None,
           stop: list[str] | tuple = (),
           skip_special_tokens: bool = True) -> tuple[list[str], DetokenizerStep | None, int, str]:
    """Feeds tokens until a stop; returns (texts from add(), the stopping step or None, number of
    tokens added, the text from finish())."""
    if prompt_ids is None:
        prompt_ids = encode(tokenizer, PROMPT)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop, skip_special_tokens=skip_special_tokens)
    texts = []
    for n, token in enumerate(output_ids, start=1):
        step = detok.add(token)
        texts.append(step.text)
        if step.stopped:
            assert detok.finish() == ""
            return texts, step, n, ""
    return texts, None, len(output_ids), detok.finish()


def reference_stop(text: str, stop: list[str]) -> tuple[str, str | None]:
    """The text before the first-completing stop string (smallest end, then smallest start)."""
    best = None
    for s in stop:
        start = text.find(s)
        if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
            best = (start + len(s), start, s)
    return (text, None) if best is None else (text[:best[1]], best[2])


# --- token ids -> text -------------------------------------------------------------------------

@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_concatenation_equals_decode_of_random_ids(tokenizer, token_pool, data) -> None:
    any_id = st.integers(0, len(tokenizer) - 1)
    token = st.one_of(any_id, st.sampled_from(token_pool))
    prompt = data.draw(st.lists(token, max_size=8), label="prompt")
    output = data.draw(st.lists(token, max_size=40), label="output")
    texts, stopped, _, tail = stream(tokenizer, output, prompt)
    assert stopped is None
    # An incomplete character at the very end is dropped (as vLLM does), never sent as U+FFFD.
    assert "".join(texts) + tail == tokenizer.decode(output, skip_special_tokens=True).rstrip(REPLACEMENT)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stop_strings_match_reference_on_random_ids(tokenizer, token_pool, data) -> None:
    """With stop strings cut from the output text itself (so they do hit) and random ones, the
    streamed result equals the full decode cut at the first-completing stop string."""
    output = data.draw(st.lists(st.sampled_from(token_pool), min_size=1, max_size=30), label="output")
    full = tokenizer.decode(output, skip_special_tokens=True).rstrip(REPLACEMENT)
    random_stop = st.text(alphabet="abc eé世🎉.", min_size=1, max_size=3)
    stop = data.draw(st.lists(random_stop, max_size=2), label="random")
    for _ in range(data.draw(st.integers(0, 2), label="cut")):
        if full:
            start = data.draw(st.integers(0, len(full) - 1))
            cut = full[start:start + data.draw(st.integers(1, 6))]
            if REPLACEMENT not in cut:
                stop.append(cut)
    texts, step, _, tail = stream(tokenizer, output, stop=stop)
    expected_text, expected_stop = reference_stop(full, stop)
    assert "".join(texts) + tail == expected_text
    # Found by add() on the completing token, never late in finish() (no stop contains U+FFFD).
    assert (step.matched_stop if step else None) == expected_stop


@pytest.mark.parametrize("text", REAL_TEXTS)
def test_real_text_round_trips_and_never_emits_half_characters(tokenizer, text: str) -> None:
    output = encode(tokenizer, text)
    texts, stopped, _, tail = stream(tokenizer, output)
    assert stopped is None
    assert "".join(texts) + tail == text == tokenizer.decode(output, skip_special_tokens=True)
    for chunk in [*texts, tail]:
        assert REPLACEMENT not in chunk


def test_emoji_split_across_tokens_is_held_until_complete(tokenizer) -> None:
    output = encode(tokenizer, "ok 🎉!")
    assert len(output) >= 3 and REPLACEMENT in tokenizer.decode(output[:-2])  # really split
    texts, _, _, tail = stream(tokenizer, output)
    assert "".join(texts) == "ok 🎉!" and tail == ""
    assert any(t == "" for t in texts)  # held at least once
    assert any("🎉" in t for t in texts)  # then emitted whole


def test_text_before_an_incomplete_character_is_not_held(tokenizer) -> None:
    ids = encode(tokenizer, "ok 🎉")  # "ok", " " + first emoji bytes, ...
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, PROMPT), [])
    assert detok.add(ids[0]).text == "ok"
    assert detok.add(ids[1]).text == " "
    assert "".join(detok.add(t).text for t in ids[2:]) == "🎉"
    # A stop string ending right before half an emoji is caught on that token, not one later.
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, PROMPT), ["ok "])
    assert detok.add(ids[0]) == DetokenizerStep("", False, None)
    assert detok.add(ids[1]) == DetokenizerStep("", True, "ok ")


def test_output_ending_inside_a_character_drops_it_at_finish(tokenizer) -> None:
    """vLLM drops a trailing incomplete UTF-8 sequence; sending U+FFFD would send a character
    the model never completed."""
    ids = encode(tokenizer, "x 🎉")
    output = ids[:-1]  # last byte missing
    assert tokenizer.decode(output).endswith(REPLACEMENT)
    texts, _, _, tail = stream(tokenizer, output)
    assert REPLACEMENT not in "".join(texts) + tail
    assert "".join(texts) + tail == "x "
    # The same with a stop string held back before the incomplete tail: the held text is kept.
    detok = IncrementalDetokenizer(tokenizer, [], ["x y"])
    assert "".join(detok.add(t).text for t in output) + detok.finish() == "x "


def test_prompt_ending_inside_a_character(tokenizer) -> None:
    ids = encode(tokenizer, "A 🎉 B")
    split = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith(REPLACEMENT))
    texts, _, _, tail = stream(tokenizer, ids[split:], prompt_ids=ids[:split])
    assert "".join(texts) + tail == tokenizer.decode(ids[split:])


def test_leading_space_of_first_output_token_is_kept(tokenizer) -> None:
    texts, _, _, tail = stream(tokenizer, encode(tokenizer, " world"), prompt_ids=encode(tokenizer, "Hello"))
    assert "".join(texts) + tail == " world"


def test_empty_prompt_and_empty_output(tokenizer) -> None:
    assert stream(tokenizer, [], prompt_ids=[]) == ([], None, 0, "")
    texts, _, _, tail = stream(tokenizer, encode(tokenizer, "fine 世界"), prompt_ids=[])
    assert "".join(texts) + tail == "fine 世界"


def test_special_tokens(tokenizer) -> None:
    output = encode(tokenizer, "a") + [2] + encode(tokenizer, " b") + [0]
    texts, _, _, tail = stream(tokenizer, output)
    assert "".join(texts) + tail == "a b"
    texts, _, _, tail = stream(tokenizer, output, skip_special_tokens=False)
    assert "".join(texts) + tail == "a<|im_end|> b<|endoftext|>"


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every decode call."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decodes_a_small_window_not_the_whole_output(tokenizer) -> None:
    counting = CountingTokenizer(tokenizer)
    output = encode(tokenizer, " ".join(REAL_TEXTS) * 8)
    assert len(output) > 1000
    detok = IncrementalDetokenizer(counting, encode(tokenizer, PROMPT * 10), ["never appears"])
    text = "".join(detok.add(t).text for t in output) + detok.finish()
    assert text == tokenizer.decode(output)
    assert max(counting.lengths) <= 12
    assert len(counting.lengths) <= 2 * len(output) + 1
    assert len(detok._ids) <= 80  # the token window is trimmed, memory stays O(1)


# --- stop strings --------------------------------------------------------------------------------

def test_no_stop_returns_the_full_text(tokenizer) -> None:
    text = "Everything is returned, nothing held. 🎉"
    texts, step, n, tail = stream(tokenizer, encode(tokenizer, text), stop=["STOP", "zzz"])
    assert step is None and "".join(texts) + tail == text


def test_stop_string_spanning_tokens(tokenizer) -> None:
    output = encode(tokenizer, "Hello world, this is the end. More text")
    texts, step, n, tail = stream(tokenizer, output, stop=["the end"])
    assert step is not None and step.stopped and step.matched_stop == "the end"
    assert "".join(texts) == "Hello world, this is "
    assert tokenizer.decode(output[:n]).endswith("the end")  # stopped on the completing token
    assert not tokenizer.decode(output[:n - 1]).endswith("the end")


def test_stop_string_inside_a_token_cuts_the_token_text(tokenizer) -> None:
    texts, step, _, _ = stream(tokenizer, encode(tokenizer, "alphabet soup"), stop=["hab"])
    assert "".join(texts) == "alp" and step.matched_stop == "hab"


def test_stop_string_at_the_very_start(tokenizer) -> None:
    texts, step, n, _ = stream(tokenizer, encode(tokenizer, "STOP here and more"), stop=["STOP"])
    assert step.stopped and step.matched_stop == "STOP" and "".join(texts) == "" and n == 1


def test_stop_string_made_of_multibyte_characters(tokenizer) -> None:
    texts, step, _, _ = stream(tokenizer, encode(tokenizer, "Fin: 🎉🚀 après"), stop=["🚀"])
    assert "".join(texts) == "Fin: 🎉" and step.matched_stop == "🚀"


def test_stop_strings_only_match_generated_text(tokenizer) -> None:
    prompt = encode(tokenizer, "Reply, then say END")
    texts, step, _, tail = stream(tokenizer, encode(tokenizer, " fine"), prompt_ids=prompt, stop=["END"])
    assert step is None and "".join(texts) + tail == " fine"
    # A stop string straddling the prompt/output boundary does not count either.
    prompt = encode(tokenizer, "the EN")
    texts, step, _, tail = stream(tokenizer, encode(tokenizer, "D of it"), prompt_ids=prompt, stop=["END"])
    assert step is None and "".join(texts) + tail == "D of it"


@pytest.mark.parametrize(("text", "stop", "expected", "matched"), [
    ("hello world", ["world", "lo w"], "hel", "lo w"),  # earliest occurrence wins, not list order
    ("hello world", ["lo w", "world"], "hel", "lo w"),
    ("xabcdy", ["bcd", "abc"], "x", "abc"),  # overlapping: "abc" completes first
    ("abcde", ["abcd", "bc"], "a", "bc"),  # nested: the first to complete wins
    ("say hi now", ["hi", "say hi"], "", "say hi"),  # same end: the one starting first wins
    ("aaa", ["aa", "aa"], "", "aa"),  # duplicates are fine
    ("the end. the end.", ["end."], "the ", "end."),  # first occurrence
])
def test_multiple_and_overlapping_stop_strings(tokenizer, text, stop, expected, matched) -> None:
    whole = encode(tokenizer, text)
    per_char = [t for ch in text for t in encode(tokenizer, ch)]  # another split into tokens
    assert tokenizer.decode(per_char) == text
    for output in (whole, per_char):
        texts, step, _, _ = stream(tokenizer, output, stop=stop)
        assert ("".join(texts), step.matched_stop) == (expected, matched)


def test_possible_stop_prefix_is_held_then_released(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, PROMPT), ["<END>"])
    texts = [detok.add(t).text for t in encode(tokenizer, "answer <EN")]
    assert "".join(texts) == "answer "
    # The held "<EN" is released as soon as it can no longer start "<END>".
    step = detok.add(encode(tokenizer, "x")[0])
    assert step == DetokenizerStep("<ENx", False, None)


def test_held_back_text_released_by_finish(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, PROMPT), ["<END>", "\n\nUser:"])
    texts = [detok.add(t).text for t in encode(tokenizer, "answer 42\n\nUse")]
    assert "".join(texts) == "answer 42"
    assert detok.finish() == "\n\nUse"
    assert detok.finish() == ""  # idempotent
    assert not detok.stopped and detok.matched_stop is None


def test_add_after_stop_or_finish_raises(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], ["a"])
    assert detok.add(encode(tokenizer, "a")[0]).stopped
    assert detok.stopped and detok.matched_stop == "a"
    with pytest.raises(RuntimeError):
        detok.add(1)
    assert detok.finish() == ""
    finished = IncrementalDetokenizer(tokenizer, [], [])
    finished.finish()
    with pytest.raises(RuntimeError):
        finished.add(1)


@pytest.mark.parametrize("stop", [[""], ["ok", ""]])
def test_empty_stop_string_is_rejected(tokenizer, stop) -> None:
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(tokenizer, [], stop)


def test_a_one_megabyte_stop_string_costs_linear_memory_and_bounded_time(tokenizer) -> None:
    """Every prefix of a 1 MB stop string would be ~500 GB (MemoryError after seconds); the KMP
    matchers hold O(length) and feed each output character once."""
    import time
    import tracemalloc

    stop = "ab" * 500_000 + "!"
    ids = encode(tokenizer, "ab" * 200 + " and then ab!")
    tracemalloc.start()
    began = time.monotonic()
    try:
        detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, PROMPT), stop=[stop, "then"])
        steps = []
        for i in ids:
            steps.append(detok.add(i))
            if detok.stopped:
                break
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    elapsed = time.monotonic() - began
    assert steps[-1].stopped
    assert detok.matched_stop == "then"
    assert "".join(s.text for s in steps) == "ab" * 200 + " and "
    assert peak < 64 * 2**20, f"peak {peak} bytes"
    assert elapsed < 10, f"{elapsed:.1f}s"


def test_long_periodic_stop_string_is_held_and_matched(tokenizer) -> None:
    stop = "ab" * 300 + "c"
    text = "x" + "ab" * 500 + "c tail"
    out, matched = reference_stop(text, [stop])
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, PROMPT), stop=[stop])
    emitted = "".join(detok.add(i).text for i in ids if not detok.stopped)
    assert (emitted, detok.matched_stop) == (out, matched)
