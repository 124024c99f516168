"""pdkv as a KV transfer backend of SGLang 0.5.23 (installed from a checkout: docs/sglang.md, "Installing").

`transfer.sglang.conn` is where SGLang's manager, sender, receiver and bootstrap server for
pdkv are imported from (each lives in a module of its role); `transfer.sglang.plugin` is
the SGLang plugin that selects them (see the README's "SGLang" section). Importing either
needs the `sglang` package.
"""
