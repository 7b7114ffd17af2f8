"""XLA's log lines around a compile: known messages that do not mean failure become one summary line each, every
other line is written back to stderr."""

import os

from jaxlong.core import xla_log

SCHEDULE = (b"E1202 08:47:21.428491   27868 gpu_hlo_schedule.cc:968] The byte size of input/output arguments "
            b"(96413466984) exceeds the base limit (67954383257). This indicates an error in the calculation!\n")
REMAT = (b"W1202 08:47:24.240351   27868 hlo_rematerialization.cc:3231] Can't reduce memory use below 89.75GiB "
         b"(96363135336 bytes) by rematerialization; only reduced to 23.72TiB (26083345875608 bytes), down from "
         b"23.72TiB (26083345875608 bytes) originally\n")


def test_known_messages_are_summarized_and_others_shown(capfd):
    with xla_log.collecting() as log:
        for _ in range(3):
            xla_log.compile_logged(lambda: os.write(2, REMAT))
        xla_log.compile_logged(lambda: os.write(2, SCHEDULE + b"F0000 something else went wrong\n"))
    err = capfd.readouterr().err
    assert err.strip() == "F0000 something else went wrong"  # unknown lines still show, known ones do not
    summary = log.summary()
    assert len(summary) == 2 and all(line.startswith("note: ") for line in summary)
    assert "rematerialization could not bring 3 compiled step(s)" in summary[0] and "23.72TiB" in summary[0]
    assert "89.8 GiB against 63.3 GiB" in summary[1]


def test_outside_a_collecting_block_nothing_is_captured(capfd):
    assert xla_log.compile_logged(lambda: os.write(2, REMAT)) == len(REMAT)
    assert capfd.readouterr().err.encode() == REMAT
