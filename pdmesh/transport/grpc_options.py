"""Channel and server options shared by every pdmesh gRPC endpoint."""

from pdmesh.transport.chunking import MAX_CHUNK_NBYTES

# Chunks stay at or below MAX_CHUNK_NBYTES; leave headroom for the message envelope.
MAX_MESSAGE_NBYTES = MAX_CHUNK_NBYTES + (1 << 20)

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_NBYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_NBYTES),
    ("grpc.so_reuseport", 0),
    # A peer that was down is dialled again within a second (gRPC's default backoff grows to two
    # minutes): a worker restarted on its address serves again at once (tests/gateway/test_pool.py).
    # Not grpc.min_reconnect_backoff_ms: gRPC core uses it as the minimum connect timeout (default
    # 20 s), and at 200 ms a TLS handshake with a busy worker is cut off ("Handshake read failed").
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
