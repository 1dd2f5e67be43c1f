"""The node's QMP clients: one per QEMU process it ever starts, so none may leave anything behind."""

from __future__ import annotations

import logging

import pytest

from aenv.vmm.machine import qmp_client


def test_qmp_clients_make_no_logger_per_vm(caplog: pytest.LogCaptureFixture) -> None:
    loggers = len(logging.Logger.manager.loggerDict)
    clients = [qmp_client(pid) for pid in range(100_000, 100_500)]
    assert len(logging.Logger.manager.loggerDict) == loggers  # the logging module keeps every logger
    with caplog.at_level(logging.WARNING, logger="qemu.qmp"):
        clients[7].logger.warning("monitor went away")
    assert caplog.messages == ["vm-100007: monitor went away"]
