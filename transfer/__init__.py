"""transfer: what crosses the wire between prefill and decode workers.

Modules, one per role: `metadata` (wire types), `engine` (UCX through NIXL), `plan`
(pure transfer plans), `prefill` (the exporter), `decode` (the fetcher), `bootstrap`
(the registry), `router` (the PD router and local deployment), `cli` (the main job).
Import from the module that owns a name; this package re-exports nothing.
"""

__all__: list[str] = []
