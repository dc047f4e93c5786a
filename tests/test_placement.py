"""Placement policies decide on crafted snapshots: pure functions, no cluster."""

import pytest

from gyreflow.cluster.placement import PLACEMENTS, Cell, ColocatedPolicy, ElasticPolicy, Move, PoolSnapshot, make_policy
from gyreflow.cluster.pools import ROLLOUT, TRAINER

NOW = 100.0


def cell(name, role, sessions=0, train=0, since=0.0, idle_since=None, moving=False):
    if role == TRAINER and train == 0 and idle_since is None:
        idle_since = 0.0
    return Cell(name, role, sessions=sessions, train_tasks=train, since=since, idle_since=idle_since, moving=moving)


def snap(*cells, train_waiting=0, route_waiting=0, backlog=None, time=NOW):
    work = sum(c.train_tasks for c in cells) + train_waiting
    return PoolSnapshot(time=time, cells=tuple(cells), train_waiting=train_waiting, route_waiting=route_waiting,
                        train_backlog_s=float(work) if backlog is None else backlog)


def targets(moves):
    return {m.cell: m.to for m in moves}


def test_registry_is_the_only_dispatch():
    assert PLACEMENTS.names() == ["async", "colocated", "elastic"]
    assert isinstance(make_policy("elastic", consolidate_batch=4), ElasticPolicy)
    with pytest.raises(ValueError, match="unknown placement mode 'sometimes'; allowed: 'async', 'colocated', 'elastic'"):
        make_policy("sometimes")


def test_async_never_moves():
    s = snap(cell("a", ROLLOUT), cell("b", ROLLOUT), cell("t", TRAINER, train=9), train_waiting=5)
    assert make_policy("async").decide(s) == []


def test_elastic_takes_idle_tail_cells_for_ready_training():
    # The tail: 6 executions left on 4 rollout cells, 5 s of gradient shares for 1 trainer.
    s = snap(cell("r0", ROLLOUT, sessions=3), cell("r1", ROLLOUT, sessions=2), cell("r2", ROLLOUT, sessions=1),
             cell("r3", ROLLOUT, sessions=0), cell("t0", TRAINER, train=5), backlog=5.0)
    moves = ElasticPolicy(consolidate_batch=4, drain_s=1.0).decide(s)
    # 6 executions fit on ceil(6/4) = 2 cells: the two with the fewest executions go (least to migrate).
    assert targets(moves) == {"r3": TRAINER, "r2": TRAINER}
    assert all("training ready" in m.reason for m in moves)


def test_elastic_short_burst_of_training_takes_no_cell():
    # Work one trainer clears within drain_s: moving a cell (and migrating) is not worth it.
    s = snap(cell("r0", ROLLOUT, sessions=1), cell("r1", ROLLOUT, sessions=1), cell("t0", TRAINER, train=8), backlog=0.4)
    assert ElasticPolicy(drain_s=1.0).decide(s) == []


def test_elastic_keeps_cells_while_executions_need_them():
    s = snap(*(cell(f"r{i}", ROLLOUT, sessions=16) for i in range(4)), cell("t0", TRAINER, train=8), backlog=30.0)
    assert ElasticPolicy(consolidate_batch=16).decide(s) == []


def test_elastic_moves_nothing_without_training_work():
    s = snap(cell("r0", ROLLOUT, sessions=1), cell("r1", ROLLOUT), cell("r2", ROLLOUT), cell("t0", TRAINER))
    assert ElasticPolicy().decide(s) == []


def test_elastic_returns_trainers_when_rollout_lacks_capacity():
    s = snap(cell("r0", ROLLOUT, sessions=40), cell("t0", TRAINER, train=1), cell("t1", TRAINER), cell("t2", TRAINER))
    moves = ElasticPolicy(consolidate_batch=16, min_trainer=1).decide(s)
    # 40 executions need 3 rollout cells: both idle trainers go back, the busy one stays.
    assert targets(moves) == {"t1": ROLLOUT, "t2": ROLLOUT}
    assert "need 3 rollout cells" in moves[0].reason


def test_elastic_spreads_crowded_rollout_onto_long_idle_trainers():
    cells_ = (cell("r0", ROLLOUT, sessions=20), cell("t0", TRAINER, idle_since=10.0), cell("t1", TRAINER, idle_since=10.0))
    moves = ElasticPolicy(consolidate_batch=32, spread_batch=8, idle_s=1.0).decide(snap(*cells_))
    assert len(moves) == 1 and moves[0].to == ROLLOUT  # one at a time
    # Not crowded: trainers stay where they are.
    assert ElasticPolicy(spread_batch=32).decide(snap(*cells_)) == []


def test_elastic_hysteresis_no_flapping():
    # Moved a moment ago: it stays put even though the work changed.
    recent = cell("t1", TRAINER, since=NOW - 0.01, idle_since=NOW - 0.01)
    s = snap(cell("r0", ROLLOUT, sessions=20), cell("t0", TRAINER, train=1), recent)
    assert ElasticPolicy(dwell_s=0.25).decide(s) == []
    # A trainer that went idle only just now is not returned for spreading either.
    fresh = [cell(f"t{i}", TRAINER, since=0.0, idle_since=NOW - 0.001) for i in range(2)]
    assert ElasticPolicy(idle_s=1.0).decide(snap(cell("r0", ROLLOUT, sessions=20), *fresh)) == []


def test_elastic_never_strands_work():
    # Never below one rollout cell (executions would have no engine) ...
    s = snap(cell("r0", ROLLOUT, sessions=1), cell("t0", TRAINER, train=7), backlog=70.0)
    assert ElasticPolicy(consolidate_batch=64).decide(s) == []
    # ... never a trainer cell with a task on it ...
    s = snap(cell("r0", ROLLOUT, sessions=40), cell("t0", TRAINER, train=1), cell("t1", TRAINER, train=1))
    assert ElasticPolicy(consolidate_batch=16).decide(s) == []
    # ... and a cell already moving is left alone (its role is the one it moves to).
    s = snap(cell("r0", ROLLOUT, sessions=2), cell("r1", TRAINER, moving=True), cell("r2", ROLLOUT),
             cell("t0", TRAINER, train=6), backlog=6.0)
    moves = ElasticPolicy(consolidate_batch=8).decide(s)
    assert "r1" not in targets(moves) and targets(moves) == {"r2": TRAINER}


def test_elastic_counts_waiting_routes_as_rollout_demand():
    s = snap(cell("r0", ROLLOUT), cell("t0", TRAINER, idle_since=0.0), cell("t1", TRAINER, idle_since=0.0),
             route_waiting=40)
    assert targets(ElasticPolicy(consolidate_batch=16, min_trainer=1).decide(s)) == {"t0": ROLLOUT}


def test_colocated_phases():
    p = ColocatedPolicy()
    # Executions live (even between two calls): every cell rolls out; busy trainers finish first.
    s = snap(cell("a", ROLLOUT, sessions=1), cell("b", TRAINER), cell("c", TRAINER, train=1))
    assert p.decide(s) == [Move("b", ROLLOUT, "executions live")]
    # No execution left and training ready: every cell trains.
    s = snap(cell("a", ROLLOUT), cell("b", ROLLOUT), train_waiting=3)
    assert targets(p.decide(s)) == {"a": TRAINER, "b": TRAINER}
    # Waiting calls (no engine at all) bring the cells back.
    s = snap(cell("a", TRAINER), cell("b", TRAINER), route_waiting=2)
    assert targets(p.decide(s)) == {"a": ROLLOUT, "b": ROLLOUT}
    # Nothing to do: nothing moves.
    assert p.decide(snap(cell("a", ROLLOUT), cell("b", TRAINER))) == []


def test_sessions_rebalance_onto_engines_that_joined():
    from gyreflow.cluster.policy import RouteSnapshot, rebalance_sessions

    # 12 sessions crowd engine a; b and c just joined the rollout pool.
    sessions = {f"s{i}": "a" for i in range(12)}
    priority = {f"s{i}": float(i) for i in range(12)}  # s11 is the youngest
    moves = rebalance_sessions(RouteSnapshot(("a", "b", "c"), sessions), priority, slack=1)
    assert len(moves) == 8 and all(src == "a" for _, src, _ in moves)
    moved = {s for s, _, _ in moves}
    assert moved == {f"s{i}" for i in range(4, 12)}  # the youngest go, the oldest stay
    assert sorted(dst for _, _, dst in moves).count("b") == 4
    # Balanced already (within the slack): nothing moves; a lone engine: nothing moves.
    assert rebalance_sessions(RouteSnapshot(("a", "b"), {"x": "a", "y": "a", "z": "b"}), {}, slack=1) == []
    assert rebalance_sessions(RouteSnapshot(("a",), sessions), priority) == []
