"""The demo application that runs the transfer library: a local PD deployment.

    python -m transfer.app                 the main job (router + supervised services)
    python -m transfer.app.bootstrap_registry        the bootstrap registry as a process
    python -m transfer.app.prefill_worker  one CP rank of a stand-in prefill engine
    python -m transfer.app.decode_worker   a decode worker that fetches and verifies

`supervisor` starts and stops the processes, `router` routes requests through them,
`api` holds the router's messages to its workers, `synthetic` the stand-in KV content
and page orders, `service` what every process entry point shares. The library
(`transfer.*` outside this package) never imports it.
"""

__all__: list[str] = []
