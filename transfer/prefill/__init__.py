"""The prefill's side of the protocol: a CP rank's exporter, its rooms and its pin words.

`exporter` registers the rank's owned buffers and takes the model's side (publish, mark
ready, chunks, pins); `service` answers decodes (claims, readiness streams, releases over
HTTP and as UCX notifications); `rooms` keeps its rooms (claims, leases, ends); `pins` its
pin words in shared memory.
"""

from transfer.prefill.exporter import PrefillExporter

__all__ = ["PrefillExporter"]
