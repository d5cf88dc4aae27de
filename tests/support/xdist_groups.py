"""Which heavy test modules must share a pytest-xdist worker, and the scheduler that keeps them together.

``make test`` runs the heavy tiers on two workers with ``--dist loadgroup``: a group runs whole on one
worker, in collection order. Every module is a group of its own, so its module fixtures start once. Modules
that share something a worker holds for the whole session are one group, listed here.

The groups come from the module path, through ``ModuleGroupScheduling`` (tests/conftest.py returns it from
``pytest_xdist_make_scheduler``), not from ``xdist_group`` marks: pytest-xdist 3.8 groups marked tests by
appending ``@group`` to ``item._nodeid``, and pytest 9.2 keeps the node id elsewhere (``Node._id``), so
the marks are silently ignored and every test is scheduled on its own.
"""

from __future__ import annotations

from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

TESTS = Path(__file__).resolve().parents[1]

SHARED_GROUPS = {
    # the session's training runs (tests/e2e/conftest.py: sync_run, off_policy_run, in_flight_run)
    "e2e-runs": ("e2e/test_train_determinism.py", "e2e/test_off_policy_train.py", "e2e/test_train_replay.py"),
    # the one Slurm cluster, in a fixed directory with fixed ports (integration/slurm_cluster.py)
    "slurm": ("integration/test_slurm_local.py", "integration/test_slurm_sft.py",
              "integration/test_slurm_ray_cluster.py", "integration/test_slurm_train.py",
              "integration/test_launch_local.py"),
    # the in-process engine that outlives a module while a later one needs it (integration/vllm_engine.py)
    "vllm-engine": ("integration/test_rollout_engine_requests.py", "integration/test_rollout_vllm.py"),
}
_GROUP_OF = {module: group for group, modules in SHARED_GROUPS.items() for module in modules}


def module_name(path: str | Path) -> str:
    """A test module's path relative to tests/, with forward slashes."""
    return Path(path).resolve().relative_to(TESTS).as_posix()


def scope_of(nodeid: str) -> str:
    """The scheduling scope of a test id (``tests/e2e/test_x.py::test_y[param]``): its module's group."""
    module = nodeid.split("::", 1)[0].removeprefix("tests/")
    return _GROUP_OF.get(module, module)


def xdist_group_of(path: str | Path) -> str:
    """The group of a test module (a path under tests/): its shared group, or the module itself."""
    return scope_of(module_name(path))


class ModuleGroupScheduling(LoadScopeScheduling):
    """pytest-xdist's scope scheduling (whole scopes to one worker, in collection order) with
    ``scope_of`` as the scope."""

    def _split_scope(self, nodeid: str) -> str:
        return scope_of(nodeid)
