"""pdkv as a KV transfer backend of SGLang 0.5.23 (installed from a checkout: docs/sglang.md, "Installing").

`transfer.sglang.conn` holds SGLang's manager, sender, receiver and bootstrap server for
pdkv; `transfer.sglang.plugin` is the SGLang plugin that selects them (see the README's
"SGLang" section). Importing either needs the `sglang` package.
"""
