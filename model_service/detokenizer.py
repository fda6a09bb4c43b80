"""Incremental detokenization of one request's output, with stop strings.

Two layers, both O(1)-ish per token (independent of the output length so far):

1. Token ids -> text. The vLLM/TGI prefix/read-offset technique: `ids[prefix_offset:read_offset]`
   is a short window of tokens already turned into text (`prefix_text`), `ids[read_offset:]` the
   tokens not yet turned into text. Each step decodes only `ids[prefix_offset:]` and takes the part
   beyond `prefix_text` as new text — unless that ends with U+FFFD, the replacement character the
   decoder produces for an incomplete multi-byte UTF-8 sequence (e.g. half an emoji): then the
   offsets stay put and only the complete text before the trailing U+FFFD run is released; the
   rest waits until a later token completes the character (so a stop string just before half an
   emoji is still caught on time). Decoding with a few earlier tokens as context keeps
   token-boundary-dependent rendering right (leading spaces of SentencePiece tokenizers); the
   prompt's last tokens are the context of the first output tokens.
   An output that still ends inside a character when generation ends loses that incomplete tail
   (vLLM drops it too: sending it as U+FFFD would send a character the model never completed).
   For byte-level BPE tokenizers (GPT-2 style, e.g. SmolLM2, Llama 3, Qwen2), the concatenation
   of everything emitted (`add` texts + `finish`) equals
   `tokenizer.decode(output_ids, skip_special_tokens=...)` with its trailing U+FFFD run removed,
   when no stop string hits.

2. Stop strings, on the generated text only (never the prompt). Generation stops at the first
   point of the text where a stop string is complete: the occurrence with the smallest end
   position (ties: the one starting first, i.e. the longest). That choice makes the outcome
   independent of how the text happens to be split into tokens. The returned text is everything
   before that occurrence; the stop string and anything after it are dropped. The longest tail of
   the text that is the beginning of some stop string is held back and released once it can no
   longer become one (or by `finish()`).
   Both are found with one Knuth-Morris-Pratt matcher per stop string, fed each new character
   once: memory is linear in the stop strings' total length (their failure tables) and the work
   per character is amortised O(number of stop strings), however long a stop string is (never
   every prefix of it, which would be quadratic).

How the engine uses it, per request:

    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=params.stop)
    for every generated token:
        if the token ends generation by id (EOS unless ignore_eos, or in stop_token_ids):
            text = detok.finish()        # the token is sent in token_ids but not in text: not add()ed
            finish_reason = STOP; matched_stop = "" for EOS, else the engine's rendering of the token
        else:
            step = detok.add(token)      # send step.text with this token id
            if step.stopped:             # finish_reason STOP, matched_stop = step.matched_stop
                ...                      # no finish() needed: the rest of the text is discarded
            elif max_tokens reached / context full / abort:
                text = step.text + detok.finish()

`finish()` releases whatever is still held back (a tail that looked like the beginning of a stop
string) and drops an unfinished multi-byte character. It is idempotent and returns "" after a stop.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

__all__ = ["DetokenizerStep", "IncrementalDetokenizer"]

# Prompt tokens used as decoding context for the first output tokens (vLLM uses 5 as well).
_PROMPT_CONTEXT_TOKENS = 5
# Drop tokens before the decode window once this many have piled up (keeps memory O(window)).
_TRIM_THRESHOLD = 64
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    """What the detokenizer needs: `transformers` tokenizers and `tokenizers.Tokenizer` both fit."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class DetokenizerStep(NamedTuple):
    """The outcome of adding one token."""

    text: str  # new text that is safe to send now (may be empty)
    stopped: bool  # a stop string completed: generation must end with this token
    matched_stop: str | None  # the stop string that completed, when stopped


class IncrementalDetokenizer:
    """Turns one request's output tokens into text incrementally and detects stop strings.

    `stop`: stop strings, each non-empty (ValueError otherwise); duplicates are fine.
    `skip_special_tokens`: passed to `tokenizer.decode` (special tokens render as nothing).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 stop: list[str] | tuple[str, ...] = (), skip_special_tokens: bool = True) -> None:
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop: tuple[str, ...] = tuple(dict.fromkeys(stop))
        # KMP failure table of each stop string, and how much of it the text ends with now.
        self._failure: tuple[list[int], ...] = tuple(_failure_table(s) for s in self._stop)
        self._state: list[int] = [0] * len(self._stop)

        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context)
        if context_text.endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a multi-byte character (or with U+FFFD itself): as context it
            # would swallow the first output bytes, so decode the output on its own.
            context, context_text = [], ""
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = context_text  # == decode(ids[prefix_offset:read_offset])
        # Characters of decode(ids[prefix_offset:]) beyond prefix_text already emitted while the
        # unread tokens still end inside an incomplete character.
        self._held_sent = 0
        self._pending = ""  # decoded generated text held back as a possible stop-string start
        self._stopped = False
        self._matched_stop: str | None = None
        self._finished = False

    @property
    def stopped(self) -> bool:
        """True once a stop string has completed."""
        return self._stopped

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended generation, if any."""
        return self._matched_stop

    def add(self, token_id: int) -> DetokenizerStep:
        """Appends one generated token; returns the text that became final and whether a stop
        string completed. Raises RuntimeError after a stop or after `finish()`."""
        if self._stopped or self._finished:
            raise RuntimeError("add() after the detokenizer stopped or finished")
        self._ids.append(token_id)
        new_text = self._decode_new(final=False)
        if not new_text:
            return DetokenizerStep("", False, None)
        return self._scan(new_text)

    def finish(self) -> str:
        """Ends the request (EOS, stop token id, max_tokens, abort): returns all text still held
        back, less a trailing incomplete character (the U+FFFD run it decodes to). A stop string completed by that text is honoured (text before it, see
        `matched_stop`). Idempotent; "" after a stop."""
        if self._stopped or self._finished:
            return ""
        self._finished = True
        step = self._scan(self._decode_new(final=True))
        if step.stopped:
            return step.text
        text, self._pending = step.text + self._pending, ""
        return text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_new(self, final: bool) -> str:
        """The text the unread tokens add beyond what was already emitted. While the text ends
        with U+FFFD (an incomplete character) the offsets stay put and only the complete text
        before it is released (counted in `_held_sent`); when `final`, the U+FFFD run is dropped
        (no later token can complete it)."""
        if self._read_offset == len(self._ids):
            return ""
        full_text = self._decode(self._ids[self._prefix_offset:])
        start = len(self._prefix_text) + self._held_sent
        if full_text.endswith(_REPLACEMENT_CHAR):
            end = len(full_text.rstrip(_REPLACEMENT_CHAR))
            if end <= start:
                return ""
            if not final:
                self._held_sent = end - len(self._prefix_text)
            return full_text[start:end]
        if len(full_text) <= start:
            return ""  # nothing visible yet (e.g. skipped special tokens)
        new_text = full_text[start:]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        self._held_sent = 0
        if self._prefix_offset >= _TRIM_THRESHOLD:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text

    def _scan(self, new_text: str) -> DetokenizerStep:
        """Adds decoded text to the held-back tail, looks for stop strings, and splits off what
        is safe to send."""
        pending = self._pending + new_text
        if not self._stop:
            self._pending = ""
            return DetokenizerStep(pending, False, None)
        stops, failures, state = self._stop, self._failure, self._state
        base = len(pending) - len(new_text)
        for offset, char in enumerate(new_text):
            best: str | None = None  # the longest stop string completed at this character
            for j, s in enumerate(stops):
                k = state[j]
                if k == len(s):  # only after a match, which ends the request: never fed again
                    k = failures[j][k - 1]
                while k and s[k] != char:
                    k = failures[j][k - 1]
                if s[k] == char:
                    k += 1
                state[j] = k
                if k == len(s) and (best is None or len(s) > len(best)):
                    best = s
            if best is not None:
                start = base + offset + 1 - len(best)
                self._stopped, self._matched_stop, self._pending = True, best, ""
                return DetokenizerStep(pending[:max(start, 0)], True, best)
        # The longest tail of the text that begins a stop string (all of it is still pending).
        hold = min(max(state, default=0), len(pending))
        self._pending = pending[len(pending) - hold:] if hold else ""
        return DetokenizerStep(pending[:len(pending) - hold], False, None)


def _failure_table(s: str) -> list[int]:
    """KMP: table[i] = length of the longest proper prefix of s[:i + 1] that is also its suffix."""
    table = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = table[k - 1]
        if s[i] == s[k]:
            k += 1
        table[i] = k
    return table
