"""radixkv cache manager: block allocator, radix tree, pools and the gRPC service."""
