"""The `specexec` command line."""

import os

# gRPC's C core writes each failed TLS handshake to stderr at INFO, past --log-format json; the failure
# reaches the user as a clear error anyway. Set before grpc loads; a user's own GRPC_VERBOSITY wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
