"""What several suites share: the server subprocess (``support.server``), the scheduler harness
(``support.scheduler``) and the crash server script (``support/crash_server.py``)."""
