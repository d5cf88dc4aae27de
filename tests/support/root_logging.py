"""An autouse fixture for every test (tests/conftest.py imports it), for those that run a CLI in-process: the CLI's ``logging.basicConfig`` adds root handlers
on pytest's capture streams, which are closed after the test; this removes the handlers the test added."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(autouse=True)
def restore_root_handlers():
    root = logging.getLogger()
    before = list(root.handlers)
    yield
    for handler in root.handlers[:]:
        if handler not in before:
            root.removeHandler(handler)
