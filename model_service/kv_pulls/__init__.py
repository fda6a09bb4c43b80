"""KV pulls between replicas (docs/kv-pulls.md): the KvTransfer service and the puller."""
