import os

import pytest

# Set before any NIXL import in the test process (see transfer.lanes.ucx.nixl).
os.environ.setdefault("UCX_MODULES", "^ib")

# The files whose cases start whole deployments, hosts or environments, longest first (as a
# run on two workers measured them). Under pytest-xdist (scripts/test.sh: a file whole on a
# worker, --no-loadscope-reorder) the next free worker takes the next file in collection
# order: the long ones start first, so none starts last while the other worker idles. The
# other files follow, in their usual order.
LONG_FIRST = (  # by their time in one run of the test command (a worker's seconds), longest first
    "test_hosts.py",
    "test_sglang_plugin.py",
    "test_etcd.py",
    "test_hostile_bodies.py",
    "test_engine_loss.py",
    "test_soak.py",
    "test_transfer_integration.py",
    "test_sglang_layout_abort.py",
    "test_sglang_scheduler_hosts.py",
    "test_router.py",
    "test_sglang_aborts.py",
    "test_cli.py",
    "test_sglang.py",
    "test_install.py",
    "test_sglang_first_room_abort.py",
    "test_sglang_hosts.py",
    "test_faults.py",
    "test_sglang_scheduler.py",
    "test_layer_split_broadcast.py",
    "test_sglang_settings.py",
    "test_release_faults.py",
    "test_connection_cap.py",
    "test_layers.py",
    "test_sglang_scheduler_parity.py",
    "test_sglang_parity.py",
    "test_metrics.py",
    "test_fd_pass.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FIRST)))  # stable: a file's cases keep their order
