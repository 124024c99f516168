"""transfer: what crosses the wire between prefill and decode workers (the library).

Modules, one per role: `metadata` (wire types), `ucx` (UCX through NIXL), `plan` (pure
transfer and gather plans), `rooms` (a rank's claims, tickets and pins), `pin_table` (the
pin words, mapped on the owner's host), `readiness` (readiness pushed on a stream per
decode and owner), `prefill` (the exporter),
`decode` (the fetcher; `owner_io` its per-owner protocol, `results` what it reports),
`metrics` (Prometheus), `logctx` (the request on every log line), `sync` (the same for
synchronous schedulers),
`bootstrap` (the registry), `http` (the control plane's HTTP), `deadline`, `timeouts`, and
the same-host GPU lane (`cuda_ipc`, `gpu_lane`, `gather`). The application that runs them
lives in `transfer.app`, which nothing here imports. Import from the module that owns a
name; this package re-exports nothing.
"""

__all__: list[str] = []
