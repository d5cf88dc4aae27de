"""The heavy tiers' pytest-xdist groups (tests/support/xdist_groups.py) keep shared session fixtures on one worker."""

import re

from support.xdist_groups import SHARED_GROUPS, TESTS, module_name, scope_of, xdist_group_of

# group -> a pattern that marks a module as a user of what the group shares
USERS = {
    "e2e-runs": re.compile(r"def test_\w+\([^)]*\b(sync_run|off_policy_run|in_flight_run)\b"),
    "slurm": re.compile(r"^from slurm_cluster import [^\n]*\bslurm_cluster\b|\.slurm-local|LocalSlurmCluster\(", re.M),
    "vllm-engine": re.compile(r"^from vllm_engine import [^\n]*\btiny_qwen3_engine\b", re.M),
}
HEAVY = [p for tier in ("dist", "e2e", "fakecuda", "integration") for p in sorted((TESTS / tier).glob("test_*.py"))]


def test_every_listed_module_exists():
    listed = [m for modules in SHARED_GROUPS.values() for m in modules]
    assert len(listed) == len(set(listed)), "a module is in two groups"
    missing = [m for m in listed if not (TESTS / m).is_file()]
    assert not missing, f"tests/support/xdist_groups.py lists modules that do not exist: {missing}"
    assert set(USERS) == set(SHARED_GROUPS)


def test_every_user_of_a_shared_fixture_is_in_its_group():
    assert len(HEAVY) > 40
    for group, pattern in USERS.items():
        users = {module_name(p) for p in HEAVY if pattern.search(p.read_text())}
        assert users, f"no module matches the {group} pattern any more; update USERS"
        outside = sorted(m for m in users if xdist_group_of(TESTS / m) != group)
        assert not outside, (f"{outside} share the {group!r} group's session fixture but would run on another "
                             f"worker: add them to SHARED_GROUPS[{group!r}] in tests/support/xdist_groups.py")


def test_other_modules_are_groups_of_their_own():
    grouped = {m for modules in SHARED_GROUPS.values() for m in modules}
    alone = [p for p in HEAVY if module_name(p) not in grouped]
    assert alone and all(xdist_group_of(p) == module_name(p) for p in alone)
    assert xdist_group_of(TESTS / "e2e" / "test_train_replay.py") == "e2e-runs"


def test_the_scheduler_scopes_test_ids_by_their_module_group():
    assert scope_of("tests/e2e/test_train_replay.py::test_replay[a::b]") == "e2e-runs"
    assert scope_of("tests/integration/test_slurm_train.py::test_x") == "slurm"
    assert scope_of("tests/dist/test_moe_train.py::test_y[tp2-ep2]") == "dist/test_moe_train.py"
    for path in HEAVY:
        assert scope_of(f"tests/{module_name(path)}::test_z") == xdist_group_of(path)


def test_every_test_module_has_its_own_basename():
    """The tiers are directories without ``__init__.py``: pytest imports a test module by its basename, so two
    modules of one name clash (pytest's "import file mismatch"), and a spawned rank that imports its own test
    module by name would get the other one."""
    seen: dict[str, str] = {}
    clashes = []
    for path in sorted(TESTS.rglob("test_*.py")):
        name = module_name(path)
        if path.name in seen:
            clashes.append(f"{seen[path.name]} and {name}")
        seen.setdefault(path.name, name)
    assert not clashes, f"test modules with one basename: {clashes}; rename one"
