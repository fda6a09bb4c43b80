"""An index of the prompts being prefilled, for the scheduler's in-batch prefix check and load."""

from __future__ import annotations

from model_service.request import Request


class PrefillIndex:
    """Requests whose prompt is being computed (admitted, pages not all committed yet), keyed by
    their first page, to find a waiting request that would compute the same prefix again."""

    MAX_CANDIDATES = 8

    def __init__(self, block_size: int, min_tokens: int) -> None:
        self.block_size = block_size
        self.min_tokens = min_tokens
        self._by_first_page: dict[tuple[int, ...], list[tuple[Request, int]]] = {}

    def add(self, request: Request, cached_tokens: int) -> None:
        """`cached_tokens`: its leading tokens the tree will hold when admissions are applied."""
        bs = self.block_size
        prompt = request.prompt_token_ids
        if not self.min_tokens or len(prompt) < self.min_tokens or cached_tokens >= len(prompt) // bs * bs:
            return  # short, or its whole prompt is in the tree already: a waiting request just hits it
        self._by_first_page.setdefault(tuple(prompt[:bs]), []).append((request, cached_tokens))

    def longest_shared(self, request: Request) -> tuple[int, int]:
        """(tokens of the longest page-aligned prefix `request` shares with an indexed prompt,
        leaving its last token to compute; that prompt's cached tokens). At most
        MAX_CANDIDATES prompts with the same first page are compared."""
        bs = self.block_size
        tokens = request.prompt_token_ids
        best = (0, 0)
        if not self._by_first_page or len(tokens) < self.min_tokens:
            return best
        for other, cached_tokens in self._by_first_page.get(tuple(tokens[:bs]), ())[-self.MAX_CANDIDATES:]:
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
