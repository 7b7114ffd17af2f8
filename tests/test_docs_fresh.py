"""The docs check's second slow test: the CPU-sized commands of the README and docs/ that start a run of their own
(`test_docs.FRESH_COMMANDS`), in a file of their own so that the slow tier runs them beside the default run's chain
(`test_docs.test_the_commands_run_when_pasted_in_order`)."""

import pytest
from test_docs import FRESH_COMMANDS, _workdir, run_in_order


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_commands_that_start_afresh_run_when_pasted_in_order(tmp_path):
    """The commands that start afresh, pasted in the order a reader meets them into one fresh directory (with
    `configs/`): each exits with 0 and prints no traceback."""
    run_in_order(FRESH_COMMANDS, _workdir(tmp_path / "work"))
