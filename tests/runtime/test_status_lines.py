"""The roles' status lines: once, on stdout, with the time of day, whatever -v says."""

from __future__ import annotations

import logging
import re

import pytest

from splitedge.cli import configure_logging


@pytest.mark.parametrize("verbose", [0, 1, 2])
def test_a_status_line_is_printed_once_with_its_time(verbose: int, capsys) -> None:
    # Prepare
    configure_logging(verbose)
    # Execute
    logging.getLogger("splitedge.status").info("edge e0: round 3/5 closed")
    # Assert
    out, err = capsys.readouterr()
    assert re.fullmatch(r"\d\d:\d\d:\d\d edge e0: round 3/5 closed\n", out), out
    assert "round 3/5" not in err
