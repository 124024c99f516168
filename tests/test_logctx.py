"""Log lines about a request name it (transfer.logctx)."""

import asyncio
import logging

from transfer.logctx import RequestFilter, request_context


async def test_lines_logged_inside_a_request_and_its_tasks_carry_its_fields(caplog):
    logger = logging.getLogger("pdkv-test-logctx")
    caplog.handler.addFilter(RequestFilter())
    with caplog.at_level(logging.INFO, logger=logger.name):
        logger.info("before")
        with request_context(engine="prefill0", rank=2, room=42, consumer=None):
            logger.info("inside")
            await asyncio.create_task(asyncio.sleep(0, result=None))
            await asyncio.ensure_future(_log_later(logger))
        logger.info("after")
    lines = {r.getMessage(): r.request for r in caplog.records}
    assert lines == {
        "before": "",
        "inside": "[engine=prefill0 rank=2 room=42] ",
        "in a task": "[engine=prefill0 rank=2 room=42] ",  # tasks inherit the request
        "after": "",
    }


async def _log_later(logger: logging.Logger) -> None:
    await asyncio.sleep(0)
    logger.info("in a task")
