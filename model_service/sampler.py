"""Next-token sampling for a batch of requests, each with its own sampling options.

Semantics follow `radixkv.v1.SamplingParams`:

- `temperature < GREEDY_TEMPERATURE` (1e-5, as vLLM; 0 included) is greedy: exactly `torch.argmax`
  of the logits (first index on ties, as `transformers`' greedy search); dividing logits by such a
  temperature would overflow to inf and the softmax to NaN. `top_k == 1` is greedy too (same
  argmax, so ties behave the same).
- Otherwise, in this order (as `transformers`' logits warpers): divide the logits by the
  temperature; keep the `top_k` largest (0 = disabled; ties with the k-th value are kept); keep
  the smallest set of most likely tokens whose probability mass reaches `top_p` (the most likely
  token is always kept; 1.0 = disabled), computed on the distribution left after top-k; drop
  the tokens whose probability (after top-k and top-p) is below `min_p` times the most likely
  token's (0 = disabled; transformers' MinPLogitsWarper); sample from the renormalised rest.
- The penalties, `logit_bias` and `min_tokens` are applied to the logits before this sampler sees
  them (model_service/logits_processors.py); a greedy row with any of them is the argmax of the
  processed logits.
- Sampling is a per-row exponential race: `argmax(probs / q)` with `q ~ Exp(1)` i.i.d. per vocab
  entry, which picks token i with probability `probs[i]`. Each row draws its `q` from its own
  `torch.Generator`, so a seeded request's tokens depend only on its seed, its logits and its
  options, never on which other requests share the batch or on its row index.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from model_service import native
from model_service.native import registry

__all__ = ["GREEDY_TEMPERATURE", "MAX_LOGIT_BIAS", "Sampler", "SamplingOptions", "make_generator"]

_MAX_SEED = 2**64 - 1
# Temperatures below this are greedy: logits / t would overflow float32 for tiny t.
GREEDY_TEMPERATURE = 1e-5
# Most logit_bias entries one request may set (OpenAI's limit is 300; 1024 bounds a step's work).
MAX_LOGIT_BIAS = 1024


@dataclass(slots=True)
class SamplingOptions:
    """One request's sampling options, validated on construction.

    `temperature`: finite and >= 0; below `GREEDY_TEMPERATURE` (0 included) = greedy.
    `top_p`: in (0, 1], 1 = disabled. `top_k`: >= 0, 0 = disabled. `seed`: in [0, 2**64) or None (see `make_generator`).
    `min_p`: in [0, 1], 0 = disabled. The logits processors' options (semantics in
    model_service/logits_processors.py): `presence_penalty` and `frequency_penalty` in [-2, 2]
    (0 = off), `repetition_penalty` > 0 (1 = off), `logit_bias` token id -> bias in [-100, 100]
    (at most `MAX_LOGIT_BIAS` entries; ids are checked against the vocabulary by the caller),
    `min_tokens` >= 0.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_params(cls, temperature: float | None = None, top_p: float | None = None,
                    top_k: int = 0, seed: int | None = None, *, min_p: float = 0.0,
                    presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                    repetition_penalty: float | None = None, logit_bias: Mapping[int, float] | None = None,
                    min_tokens: int = 0) -> SamplingOptions:
        """Builds options from the proto's optional fields: unset (None) temperature and top_p
        mean 1.0, unset repetition_penalty 1.0. Raises ValueError on bad values."""
        return cls(temperature=1.0 if temperature is None else float(temperature),
                   top_p=1.0 if top_p is None else float(top_p),
                   top_k=int(top_k), seed=seed, min_p=float(min_p),
                   presence_penalty=float(presence_penalty), frequency_penalty=float(frequency_penalty),
                   repetition_penalty=1.0 if repetition_penalty is None else float(repetition_penalty),
                   logit_bias={int(k): float(v) for k, v in (logit_bias or {}).items()},
                   min_tokens=int(min_tokens))

    def validate(self) -> None:
        """Raises ValueError with a message naming the field when any value is out of range."""
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool):
            raise ValueError(f"top_p must be a number, got {self.top_p!r}")
        if not 0.0 < self.top_p <= 1.0:  # also rejects nan
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed <= _MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:  # also rejects nan
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a finite number in [-2, 2], got {value!r}")
        if (not _is_number(self.repetition_penalty) or not math.isfinite(self.repetition_penalty)
                or self.repetition_penalty <= 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        # Bounded: every step adds each entry to its row's logits (one scatter), and the request's
        # bias tensors stay on the device for its whole life.
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
            if not _is_number(bias) or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be finite numbers in [-100, 100], "
                                 f"got {bias!r} for token {token}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax of the logits (temperature below
        `GREEDY_TEMPERATURE`, 0 included, or top_k 1)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        """True when the request needs token counts (presence, frequency or repetition penalty)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def uses_processors(self) -> bool:
        """True when any logits processor applies to the request (penalties, logit_bias, min_tokens)."""
        return self.uses_penalties or bool(self.logit_bias) or self.min_tokens > 0


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A request's random generator on `device`: seeded with `seed`, so the request's sampled
    tokens are reproducible. For `seed=None` returns None: the request then draws from torch's
    global generator of the device (not reproducible, and cheaper, since the sampler draws all
    such rows of a batch at once)."""
    if seed is None:
        return None
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Picks one next token per row of a logits batch. Stateless; one instance can serve all steps."""

    def sample(self, logits: torch.Tensor, options: list[SamplingOptions],
               generators: list[torch.Generator | None]) -> torch.Tensor:
        """Returns the next token id of every row: int64 tensor [batch] on `logits.device`.

        `logits`: [batch, vocab] (float32 expected; other float dtypes are upcast for sampling).
        `options[i]` and `generators[i]` belong to row i; a None generator uses torch's global
        generator. Greedy rows consume no random numbers; every sampled row consumes exactly
        `vocab` exponential draws from its generator per call.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        batch = logits.shape[0]
        if len(options) != batch or len(generators) != batch:
            raise ValueError(f"need one option and one generator per row: batch {batch}, "
                             f"{len(options)} options, {len(generators)} generators")
        greedy = [opt.is_greedy for opt in options]
        if all(greedy):
            return _argmax(logits)

        device = logits.device
        sampled_rows = [i for i, g in enumerate(greedy) if not g]
        sampled_opts = [options[i] for i in sampled_rows]
        if len(sampled_rows) == batch:
            tokens = self._sample_rows(logits, sampled_opts, generators)
        else:
            tokens = _argmax(logits)
            index = torch.tensor(sampled_rows, dtype=torch.long, device=device)
            tokens[index] = self._sample_rows(logits[index], sampled_opts,
                                              [generators[i] for i in sampled_rows])
        return tokens

    def _sample_rows(self, logits: torch.Tensor, options: list[SamplingOptions],
                     generators: list[torch.Generator | None]) -> torch.Tensor:
        """Samples every row of `logits` (all non-greedy) with temperature, top-k, top-p and min_p."""
        device = logits.device
        rows, vocab = logits.shape
        scores = logits.to(torch.float32, copy=True)
        temperatures = torch.tensor([opt.temperature for opt in options], dtype=torch.float32,
                                    device=device)
        scores.div_(temperatures.unsqueeze(1))

        top_ks = [min(opt.top_k, vocab) if opt.top_k > 0 else vocab for opt in options]
        if min(top_ks) < vocab:
            max_k = max(top_ks)
            top_values = scores.topk(max_k, dim=-1, sorted=True).values  # [rows, max_k], descending
            k_index = torch.tensor(top_ks, dtype=torch.long, device=device).sub_(1).unsqueeze(1)
            threshold = top_values.gather(1, k_index)  # the k-th largest score of each row
            scores.masked_fill_(scores < threshold, -math.inf)

        top_ps = [opt.top_p for opt in options]
        if min(top_ps) < 1.0:
            sorted_scores, order = scores.sort(dim=-1, descending=True)
            sorted_probs = sorted_scores.softmax(dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1).sub_(sorted_probs)  # mass of more likely tokens
            top_p = torch.tensor(top_ps, dtype=torch.float32, device=device).unsqueeze(1)
            drop_sorted = mass_before >= top_p
            drop_sorted[:, 0] = False  # the most likely token always stays
            drop_sorted &= top_p < 1.0  # rows with top_p 1 keep everything despite rounding
            drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
            scores.masked_fill_(drop, -math.inf)

        probs = scores.softmax(dim=-1)
        min_ps = [opt.min_p for opt in options]
        if max(min_ps) > 0.0:  # transformers' MinPLogitsWarper, on the distribution after top-k / top-p
            min_p = torch.tensor(min_ps, dtype=torch.float32, device=device).unsqueeze(1)
            threshold = probs.amax(dim=-1, keepdim=True).mul_(min_p)
            probs.masked_fill_(probs < threshold, 0.0)  # the race needs no renormalising
        race = self._exponentials(rows, vocab, generators, device)
        return _argmax(probs.div_(race))

    @staticmethod
    def _exponentials(rows: int, vocab: int, generators: list[torch.Generator | None],
                      device: torch.device) -> torch.Tensor:
        """[rows, vocab] i.i.d. Exp(1) draws; row i from `generators[i]` (rows without one are
        drawn together from the global generator). Clamped away from 0 so `probs / q` stays finite."""
        race = torch.empty(rows, vocab, dtype=torch.float32, device=device)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if len(unseeded) == rows:
            race.exponential_()
        else:
            if unseeded:
                index = torch.tensor(unseeded, dtype=torch.long, device=device)
                race[index] = torch.empty(len(unseeded), vocab, dtype=torch.float32,
                                          device=device).exponential_()
            for i, generator in enumerate(generators):
                if generator is not None:
                    race[i].exponential_(generator=generator)
        return race.clamp_(min=torch.finfo(torch.float32).tiny)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)`; 16-bit logits are upcast first (exact, same ties), because torch's
    CPU argmax over bfloat16 is ~2.5x slower than a float32 copy and its argmax together. On CPU
    rows go through the native kernel where it is built (the same answer, ~10x faster)."""
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.shape[1] > 0 and logits.stride(1) == 1 and registry.active("argmax")):
        return native.argmax_rows(logits)
    return logits.argmax(dim=-1)
