"""radixkv router: one ModelService endpoint (gRPC, and OpenAI-compatible HTTP) in front of many
model replicas, sending each request where its prompt's KV prefix is cached (the cache manager's
Route), with least-loaded / round-robin fallbacks and retries before the first token."""
