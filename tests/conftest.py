import os

# Set before any NIXL import in the test process (see transfer.ucx).
os.environ.setdefault("UCX_MODULES", "^ib")
