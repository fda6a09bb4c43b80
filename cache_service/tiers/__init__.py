"""Lower tiers of a pool: the replica's host memory and disk, below its device blocks.

`lower_tier.LowerTier` is one tier's slots and prefix tree; `pool_tiers.PoolTiers` decides, for
one pool, what is copied down (evicted or newly cached pages), what an admission loads back,
and applies the replica's reports of completed copies (docs/tiers.md).
"""
