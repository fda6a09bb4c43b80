"""An index of the prompts being prefilled, for the scheduler's in-batch prefix check and load."""

from __future__ import annotations

from model_service.request import Request


class PrefillIndex:
    """Prompts keyed by their namespace and first page, with how many of their leading tokens the
    tree holds (prompts of different namespaces never share cached blocks, so they never match).

    Default: the prompts being computed (admitted, pages not all committed yet), to find a waiting
    request that would compute the same prefix again. `cached=True`: the prompts whose leading
    pages the tree holds (or will once this step's commits apply), to estimate a waiting request's
    cache hit before the cache manager answers (`expected_hit`)."""

    MAX_CANDIDATES = 8

    def __init__(self, block_size: int, min_tokens: int, cached: bool = False) -> None:
        self.block_size = block_size
        self.min_tokens = min_tokens
        self.cached = cached
        self._by_first_page: dict[tuple[str, tuple[int, ...]], list[tuple[Request, int]]] = {}

    def add(self, request: Request, cached_tokens: int) -> None:
        """`cached_tokens`: its leading tokens the tree will hold when admissions are applied."""
        bs = self.block_size
        prompt = request.prompt_token_ids
        if not self.min_tokens or len(prompt) < self.min_tokens:
            return
        if (cached_tokens < bs) if self.cached else (cached_tokens >= len(prompt) // bs * bs):
            return  # nothing of it to hit / its whole prompt is in the tree: a waiting request hits it
        self._by_first_page.setdefault((request.namespace, tuple(prompt[:bs])), []).append((request, cached_tokens))

    def longest_shared(self, request: Request) -> tuple[int, int]:
        """(tokens of the longest page-aligned prefix `request` shares with an indexed prompt of its
        namespace, leaving its last token to compute; that prompt's cached tokens). At most
        MAX_CANDIDATES prompts with the same first page are compared."""
        bs = self.block_size
        tokens = request.prompt_token_ids
        best = (0, 0)
        if not self._by_first_page or len(tokens) < self.min_tokens:
            return best
        key = (request.namespace, tuple(tokens[:bs]))
        for other, cached_tokens in self._by_first_page.get(key, ())[-self.MAX_CANDIDATES:]:
            theirs = other.prompt_token_ids
            limit = min(len(tokens) - 1, len(theirs)) // bs * bs  # a hit leaves one token to compute
            common = bs
            while common < limit and tokens[common : common + bs] == theirs[common : common + bs]:
                common += bs
            common = min(common, limit)
            if common > best[0]:
                best = (common, cached_tokens)
        return best

    def shares_uncached_prefix(self, request: Request) -> bool:
        common, cached_tokens = self.longest_shared(request)
        return common >= self.min_tokens and cached_tokens < common

    def expected_hit(self, request: Request) -> int:
        """Leading tokens of `request` an indexed prompt has in the tree (an estimate: they may be
        evicted before it is admitted)."""
        common, cached_tokens = self.longest_shared(request)
        return min(common, cached_tokens)
