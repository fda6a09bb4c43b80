from tests.cache.conftest import start_server  # noqa: F401  (the real cache_service process)
