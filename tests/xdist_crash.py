"""scripts/test.sh's `-n 2 --dist loadfile` run goes on after a worker process dies, instead of hanging.

pytest-xdist 3.8.0 (the newest release) hangs there: `LoadScopeScheduling.remove_node` puts the dead worker's whole
workload back on the queue, the modules it had finished included, and a worker handed one of those is sent no test
and waits forever (pytest-xdist issues #784, #1323, #1327; PRs #1324, #1328, #1363 and #1371). CI met it on
2026-12-05: XLA aborted one worker at 4 % of the suite and the run hung until CI killed it 75 minutes later.

`CrashSafeLoadFile` keeps xdist's scheduling and changes what happens to the dead worker's work: the test it died in
is reported failed once (by xdist, as before) and not run again (it would most likely take the next worker down
too), finished modules stay finished, and the rest of its modules go back on the queue. A worker given the last
module of the queue is told to finish, since it runs a test only once it knows the next one (or that none follows).
The run then ends with every other test's result and the crash among the failures.

Registered by tests/conftest.py where pytest-xdist is installed; `python -m pytest -p tests.xdist_crash` loads it
alone (tests/test_xdist_crash.py).
"""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadFileScheduling


class CrashSafeLoadFile(LoadFileScheduling):
    def remove_node(self, node):
        """The test `node` died in (None when it had finished its work); its unfinished modules queued again."""
        workload = self.assigned_work.pop(node)
        pending = [(scope, nodeid) for scope, unit in workload.items() for nodeid, done in unit.items() if not done]
        if not pending:
            return None
        scope, crashed = pending[0]  # a worker runs its tests in the order they were sent
        workload[scope][crashed] = True
        self.workqueue.update((scope, unit) for scope, unit in workload.items() if not all(unit.values()))
        for other in self.assigned_work:
            self._reschedule(other)
        return crashed

    def _assign_work_unit(self, node) -> None:
        super()._assign_work_unit(node)
        if not self.workqueue and not node.shutting_down:
            node.shutdown()


@pytest.hookimpl
def pytest_xdist_make_scheduler(config, log):
    return CrashSafeLoadFile(config, log) if config.getvalue("dist") == "loadfile" else None
