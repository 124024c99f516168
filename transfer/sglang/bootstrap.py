"""SGLang's KV bootstrap server for pdkv: pdkv's registry at SGLang's bootstrap address."""

from __future__ import annotations

import logging

from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer

from transfer.registry.server import RegistryServer
from transfer.sglang.topology import secret, sglang_timeouts
from transfer.sync import BackgroundLoop

__all__ = ["PdkvKVBootstrapServer"]

logger = logging.getLogger(__name__)


class PdkvKVBootstrapServer(BaseKVBootstrapServer):
    """pdkv's registry at SGLang's bootstrap address, on a thread of its own."""

    __module__ = "transfer.sglang.conn"  # named by its import path, as before the split (reprs, logs, checks)

    def __init__(self, host: str, port: int) -> None:
        self._loop = BackgroundLoop("pdkv-sglang-bootstrap")
        self._timeouts = sglang_timeouts()
        # Its prefill's ranks register once their model has loaded, and SGLang gives a decode its
        # bootstrap timeout to find them: an engine unknown until then is waited for, not a typo.
        grace = self._timeouts.lookup
        self._server = RegistryServer(host=host, port=port, timeouts=self._timeouts, secret=secret(), grace=grace)
        self.url = self._loop.run(self._server.start(), self._timeouts.start)
        logger.info("pdkv bootstrap server (registry) at %s", self.url)

    def close(self) -> None:
        self._loop.run(self._server.aclose(), self._timeouts.start)
        self._loop.stop(self._timeouts.start)
