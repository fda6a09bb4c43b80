"""A replica's KV tiers below its device pool (issue 29, docs/tiers.md): pages of KV copied to
host memory (`HostTier`) and to a preallocated slot file on disk (`DiskTier`). The cache manager
allocates every slot and orders every copy (protos/cache.proto, "Ordering contract"); these
classes only store and verify pages."""
