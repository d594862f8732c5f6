"""A rank that stopped for a notice ignores that notice again while it leaves.

``skylift launch`` relays the cloud's notice to every worker as SIGTERM, and a worker's
own rank 0 may have polled the same notice first. A rank already past its checkpoint
and in the exit barrier that died of the relayed SIGTERM used to fail its peers'
barrier (exit 2 instead of 143). Each case runs in a child process of its own, since a
SIGTERM that is not ignored ends the process.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from skylift.config.schema import PreemptionConfig
    from skylift.loop.agreement import StepAgreement
    from skylift.train.preemption import PreemptionWatch

    leaving_for_s = None if sys.argv[1] == "none" else float(sys.argv[1])
    watch = PreemptionWatch(PreemptionConfig(cloud="off"), StepAgreement(), local_rank=0)
    watch.start()
    os.kill(os.getpid(), signal.SIGTERM)  # the notice: recorded, the process goes on
    time.sleep(0.05)
    assert watch.notice is not None and watch.notice.detail == "SIGTERM", watch.notice
    print("noticed", flush=True)
    watch.stop(leaving_until_s=None if leaving_for_s is None else time.time() + leaving_for_s)
    time.sleep(max(0.0, -(leaving_for_s or 0.0)))
    os.kill(os.getpid(), signal.SIGTERM)  # the launcher's relay of the same notice, or a later one
    time.sleep(0.2)
    print("survived", flush=True)
""")


def _run(leaving_for_s: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _CHILD, leaving_for_s], capture_output=True, text=True, timeout=120)


def test_a_sigterm_while_leaving_for_the_notice_does_not_end_the_rank():
    child = _run("60")
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["noticed", "survived"]


@pytest.mark.parametrize("leaving_for_s", ["none", "-0.1"], ids=["no-notice-stop", "past-the-deadline"])
def test_a_sigterm_after_the_watch_acts_as_before_it(leaving_for_s):
    """Without a notice stop, or once the notice's deadline passed, SIGTERM ends the process."""
    child = _run(leaving_for_s)
    assert child.returncode == -signal.SIGTERM, (child.returncode, child.stdout, child.stderr)
    assert child.stdout.split() == ["noticed"]
