"""Code shared by the radixkv servers (cache_service, model_service, router)."""
