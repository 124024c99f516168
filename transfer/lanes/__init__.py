"""Lanes: the only code that moves bytes (see `transfer.lanes.base`)."""
