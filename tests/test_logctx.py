"""Log lines about a request name it (transfer.logctx)."""

import asyncio
import json
import logging

from pdkv import PeerLostError
from transfer.logctx import FIELDS, RequestFilter, failure_fields, request_context


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


async def test_the_requests_fields_are_separate_record_fields_and_a_failure_names_its_peer(caplog):
    """Each field is its own attribute (None outside a request; a bound `rank` is `cp_rank`);
    a failure's `extra=failure_fields(...)` takes what the error names (a lost owner's engine,
    CP rank and peer) over the bound fields, and the filter leaves what `extra` gave."""
    logger = logging.getLogger("pdkv-test-logctx-fields")
    caplog.handler.addFilter(RequestFilter())
    with caplog.at_level(logging.INFO, logger=logger.name):
        logger.info("outside")
        with request_context(engine="prefill0", rank=2, room=42):
            logger.info("inside")
            lost = PeerLostError("gone", "prefill1.cp3.abc", ("prefill1", 3))
            logger.warning("failed", extra=failure_fields(lost, consumer="decode0"))
    got = {r.getMessage(): tuple(getattr(r, f) for f in FIELDS) for r in caplog.records}
    assert got == {  # (room, engine, cp_rank, peer, consumer)
        "outside": (None, None, None, None, None),
        "inside": (42, "prefill0", 2, None, None),
        "failed": (42, "prefill1", 3, "prefill1.cp3.abc", "decode0"),
    }
    assert caplog.records[-1].levelno == logging.WARNING


def test_json_lines_through_the_standard_logging_configuration(tmp_path):
    """docs/logging-json.json, as `PDKV_LOG_CONFIG` hands it to `logging.config.dictConfig`:
    one JSON object a line, the request's fields as keys."""
    import io
    import logging.config
    from pathlib import Path

    config = json.loads((Path(__file__).parent.parent / "docs" / "logging-json.json").read_text())
    stream = io.StringIO()
    config["handlers"]["stderr"]["stream"] = stream  # the file's handler, writing here instead
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        logging.config.dictConfig(config)
        logger = logging.getLogger("pdkv-test-logctx-json")
        with request_context(engine="prefill0", rank=1, room=7):
            logger.warning("room %d aborted", 7, extra=failure_fields(peer="decode3"))
        line = json.loads(stream.getvalue().splitlines()[-1])
    finally:
        for h in root.handlers[:]:
            root.removeHandler(h)
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])
    assert line["message"] == "room 7 aborted" and line["level"] == "WARNING"
    assert {k: line[k] for k in ("room", "engine", "cp_rank", "peer")} == {
        "room": 7,
        "engine": "prefill0",
        "cp_rank": 1,
        "peer": "decode3",
    }
    assert "consumer" not in line  # unknown fields are left out


def test_sglangs_failed_transfer_is_a_warning_naming_its_room_engine_rank_and_peer(caplog):
    """The SGLang adapter's outcome of a failed transfer (was INFO, with no room unless the
    error's text had it)."""
    from transfer.sglang.outcome import Outcome

    outcome = Outcome(lambda: {"room": 17, "engine": "dp1"})  # a receiver's: the lost owner names its rank
    with caplog.at_level(logging.INFO, logger="transfer.sglang.outcome"):
        outcome.fail(PeerLostError("owner lost", "dp1.cp2.abc", ("dp1", 2)))
        outcome.fail(PeerLostError("a second failure is not logged"))
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and record.getMessage() == "pdkv transfer of room 17 failed: owner lost"
    assert (record.room, record.engine, record.cp_rank, record.peer) == (17, "dp1", 2, "dp1.cp2.abc")
