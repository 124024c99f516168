"""The UCX lane: NIXL's UCX backend, one-sided READs from owners anywhere."""
