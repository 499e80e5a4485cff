"""Child processes: a stop signal to the whole process group is the main process's to handle, and
children that do not stop are killed within one shared deadline."""

from __future__ import annotations

import os
import signal
import time

from personaplex_demo.procs.launcher import Child, Inbox, stop_children


def deaf(spec, conn) -> None:
    """A child that says it is up, then never reads its channel: `Stop` goes unheard."""
    conn.send(["up"])
    time.sleep(600)


def test_children_leave_stop_signals_to_the_main_process_and_unheard_ones_are_killed_within_one_deadline():
    inboxes = [Inbox() for _ in range(2)]
    children = [Child(f"deaf-{i}", deaf, None).start(inbox.on_batch, inbox.on_close)
                for i, inbox in enumerate(inboxes)]
    try:
        assert [inbox.get() for inbox in inboxes] == ["up", "up"]  # past the preamble that sets the signals
        for child in children:
            os.kill(child.process.pid, signal.SIGTERM)
            os.kill(child.process.pid, signal.SIGINT)
        time.sleep(0.5)
        assert all(child.alive for child in children)
        began = time.monotonic()
        stop_children(children, 2.0)
        took = time.monotonic() - began
    finally:
        for child in children:
            if child.alive:
                child.kill()
    assert not any(child.alive for child in children)
    assert children[0].process.exitcode == -signal.SIGKILL
    assert 2.0 <= took < 3.5, took  # one deadline for all of them, not 2 s for each in turn
