"""Example programs built on radixkv\x27s public gRPC APIs."""
