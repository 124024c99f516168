import os

# Set before any NIXL import in the test process (see transfer.lanes.ucx.nixl).
os.environ.setdefault("UCX_MODULES", "^ib")
