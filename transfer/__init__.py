"""transfer: what crosses the wire between prefill and decode workers."""
