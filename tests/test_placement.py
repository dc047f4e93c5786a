"""Placement policies decide on crafted snapshots: pure functions, no cluster."""

import pytest

from gyreflow.cluster.modes import PLACEMENTS, make_policy
from gyreflow.cluster.placement import Cell, ColocatedPolicy, ElasticPolicy, LendPolicy, Move, PoolSnapshot
from gyreflow.cluster.pools import ROLLOUT, TRAINER

NOW = 100.0


def cell(name, role, sessions=0, train=0, since=0.0, idle_since=None, moving=False, home=None, queued=0):
    """``train`` trainer tasks running on the cell, ``queued`` more waiting there."""
    if role == TRAINER and train + queued == 0 and idle_since is None:
        idle_since = 0.0
    return Cell(name, role, sessions=sessions, train_tasks=train + queued, train_running=train, since=since,
                idle_since=idle_since, moving=moving, home=home or role)


def snap(*cells, train_waiting=0, route_waiting=0, backlog=None, time=NOW):
    work = sum(c.train_tasks for c in cells) + train_waiting
    return PoolSnapshot(time=time, cells=tuple(cells), train_waiting=train_waiting, route_waiting=route_waiting,
                        train_backlog_s=float(work) if backlog is None else backlog)


def targets(moves):
    return {m.cell: m.to for m in moves}


def test_registry_is_the_only_dispatch():
    assert PLACEMENTS.names() == ["async", "colocated", "elastic", "lend"]
    assert isinstance(make_policy("elastic", consolidate_batch=4), ElasticPolicy)
    with pytest.raises(ValueError, match="unknown placement mode 'sometimes'; allowed: 'async', 'colocated', 'elastic', 'lend'"):
        make_policy("sometimes")
    with pytest.raises(ValueError, match="placement 'async' has no option 'dwell_s'; allowed: none"):
        make_policy("async", dwell_s=1.0)


def test_modes_carry_their_behaviour():
    colocated, static, lend, elastic = (PLACEMENTS.get(n) for n in ("colocated", "async", "lend", "elastic"))
    # Staleness: colocated is on-policy whatever the run asks; the others keep the bound.
    assert colocated.staleness(1) == 0 and static.staleness(1) == 1 and elastic.staleness(2) == 2
    # Start split: colocated starts with every cell rolling out.
    assert colocated.start_split(6, 2) == (8, 0) and static.start_split(6, 2) == (6, 2)
    # Weights: only modes whose trainer cells may roll out publish to them.
    assert not static.trainers_roll_out and lend.trainers_roll_out and elastic.trainers_roll_out
    # Joiners take the split's proportion: a quarter of 4 joiners of a 6:2 split train.
    assert static.join_role(6, 2, 4).count(True) == 1 and colocated.join_role(6, 2, 4) == [False] * 4
    assert sum(static.join_role(5, 5, 10)) == 5
    # Shapes a mode cannot work on are refused with the fix named.
    assert static.check(1, 0) and "trainer_workers >= 1" in static.check(1, 0)
    why = elastic.check(1, 1, min_rollout=1, min_trainer=1)
    assert "cannot move a cell on 2 cell(s)" in why and "cluster.rollout_workers=2" in why
    assert elastic.check(2, 1) is None and colocated.check(1, 0) is None and lend.check(2, 1) is None
    assert static.options() == [] and "dwell_s" in elastic.options()


def test_lend_lends_idle_trainers_and_takes_them_back():
    p = LendPolicy(idle_s=5.0, dwell_s=1.0)
    # No training work, executions live: a home trainer idle long enough is lent to rollout.
    s = snap(cell("r0", ROLLOUT, sessions=9), cell("t0", TRAINER, idle_since=NOW - 10))
    assert p.decide(s) == [Move("t0", ROLLOUT, "no training work: lent to rollout")]
    assert p.decide(snap(cell("r0", ROLLOUT, sessions=9), cell("t0", TRAINER, idle_since=NOW - 1))) == []
    # Training work arrives: every lent cell goes back, rollout-home cells never train.
    s = snap(cell("r0", ROLLOUT, sessions=9), cell("t0", ROLLOUT, sessions=4, home=TRAINER),
             cell("t1", ROLLOUT, home=TRAINER), train_waiting=3)
    assert targets(p.decide(s)) == {"t0": TRAINER, "t1": TRAINER}
    # A cell lent a moment ago stays put (dwell).
    s = snap(cell("r0", ROLLOUT), cell("t0", ROLLOUT, home=TRAINER, since=NOW - 0.5), train_waiting=3)
    assert p.decide(s) == []


def test_async_never_moves():
    s = snap(cell("a", ROLLOUT), cell("b", ROLLOUT), cell("t", TRAINER, train=9), train_waiting=5)
    assert make_policy("async").decide(s) == []


def test_elastic_takes_cells_for_ready_training_least_loaded_first():
    # 5 s of gradient shares ready for 1 trainer cell, to be cleared within 1 s: 5 cells' worth.
    s = snap(cell("r0", ROLLOUT, sessions=3), cell("r1", ROLLOUT, sessions=2), cell("r2", ROLLOUT, sessions=1),
             cell("r3", ROLLOUT, sessions=0), cell("t0", TRAINER, train=5), backlog=5.0)
    moves = ElasticPolicy(drain_s=1.0).decide(s)
    # One rollout cell stays (min_rollout); the three with the fewest executions go: the least to migrate.
    assert targets(moves) == {"r3": TRAINER, "r2": TRAINER, "r1": TRAINER}
    assert all("training needs 5.0 cells" in m.reason for m in moves)


def test_elastic_keeps_up_with_the_rate_of_training_work():
    # Little is ready now, but 2.2 cell-seconds of training arrive every second: 1 trainer is short.
    # Every rollout cell is busy (180 executions would need 23 at 8 each): only the rate takes cells,
    # the 3 that keep up with 2.2 * 1.1 = 2.42 cell-s/s.
    s = snap(*(cell(f"r{i}", ROLLOUT, sessions=30) for i in range(6)), cell("t0", TRAINER, train=1))
    s = PoolSnapshot(time=s.time, cells=s.cells, train_backlog_s=2.0, train_rate=2.2)
    moves = ElasticPolicy(drain_s=1.0, headroom=0.1).decide(s)  # need 2.2 * 1.1 + 2.0 = 4.42 cells
    assert targets(moves) == {"r0": TRAINER, "r1": TRAINER}
    # Work that would not keep a moved cell busy for a dwell time takes no busy rollout cell.
    thin = PoolSnapshot(time=s.time, cells=s.cells, train_backlog_s=0.1, train_rate=2.2)
    assert ElasticPolicy(drain_s=1.0, headroom=0.1, dwell_s=0.25).decide(thin) == []
    # With fewer executions, spare rollout cells move (30 executions need 4 of the 6 at 8 each).
    light = snap(*(cell(f"r{i}", ROLLOUT, sessions=5) for i in range(6)), cell("t0", TRAINER, train=1))
    light = PoolSnapshot(time=light.time, cells=light.cells, train_backlog_s=2.0, train_rate=2.2)
    assert len(ElasticPolicy(drain_s=1.0, headroom=0.1).decide(light)) == 2  # the 2 spare, of ceil(4.42 - 1.5) = 3
    # Within half a cell of the need: nothing moves (no flapping around a fractional need).
    s2 = PoolSnapshot(time=s.time, cells=s.cells, train_backlog_s=0.1, train_rate=1.2)  # 1.42 cells
    assert ElasticPolicy(drain_s=1.0, headroom=0.1).decide(s2) == []


def test_elastic_short_burst_of_training_takes_no_cell():
    s = snap(cell("r0", ROLLOUT, sessions=1), cell("r1", ROLLOUT, sessions=1), cell("t0", TRAINER, train=8), backlog=0.4)
    assert ElasticPolicy(drain_s=1.0).decide(s) == []


def test_elastic_moves_nothing_without_training_work_or_crowding():
    s = snap(cell("r0", ROLLOUT, sessions=1), cell("r1", ROLLOUT), cell("r2", ROLLOUT), cell("t0", TRAINER))
    assert ElasticPolicy().decide(s) == []


def test_elastic_idle_trainers_roll_out_when_executions_wait_for_slots():
    # 40 executions, 16 per rollout cell at most: both idle trainers help (one trainer cell stays).
    s = snap(cell("r0", ROLLOUT, sessions=40), cell("t0", TRAINER, train=1), cell("t1", TRAINER), cell("t2", TRAINER))
    moves = ElasticPolicy(consolidate_batch=16, min_trainer=1, idle_s=1.0).decide(s)
    assert targets(moves) == {"t1": ROLLOUT, "t2": ROLLOUT}
    assert "40 executions wait for batch slots on 1 rollout cells" == moves[0].reason


def test_elastic_idle_trainers_beyond_the_need_spread_crowded_rollout():
    cells_ = (cell("r0", ROLLOUT, sessions=20), cell("t0", TRAINER, idle_since=10.0), cell("t1", TRAINER, idle_since=10.0),
              cell("t2", TRAINER, idle_since=10.0))
    moves = ElasticPolicy(consolidate_batch=32, spread_batch=8, idle_s=1.0).decide(snap(*cells_))
    assert {m.to for m in moves} == {ROLLOUT} and len(moves) == 2  # need 0: all but min_trainer
    # The measured rate of training work says they will be needed: they stay (1.5 cell-s/s needs
    # two to keep up: one of three rolls out; 2.5 keeps all three).
    busy = PoolSnapshot(time=NOW, cells=cells_, train_rate=1.5)
    assert len(ElasticPolicy(consolidate_batch=32, spread_batch=8, idle_s=1.0, headroom=0.0).decide(busy)) == 1
    busier = PoolSnapshot(time=NOW, cells=cells_, train_rate=2.5)
    assert ElasticPolicy(consolidate_batch=32, spread_batch=8, idle_s=1.0, headroom=0.0).decide(busier) == []
    # One execution per rollout cell: nothing to spread, trainers stay where they are.
    alone = (cell("r0", ROLLOUT, sessions=1), *cells_[1:])
    assert ElasticPolicy().decide(snap(*alone)) == []


def test_elastic_hysteresis_no_flapping():
    # Moved a moment ago: it stays put even though the work changed.
    recent = cell("t1", TRAINER, since=NOW - 0.01, idle_since=NOW - 0.01)
    s = snap(cell("r0", ROLLOUT, sessions=40), cell("t0", TRAINER, train=1), recent, backlog=2.0)
    assert ElasticPolicy(dwell_s=0.25, consolidate_batch=16).decide(s) == []
    # A trainer that went idle only just now does not spread a rollout cell with free slots ...
    fresh = [cell(f"t{i}", TRAINER, since=0.0, idle_since=NOW - 0.001) for i in range(2)]
    assert ElasticPolicy(idle_s=1.0, consolidate_batch=8).decide(snap(cell("r0", ROLLOUT, sessions=8), *fresh)) == []
    # ... but executions waiting for batch slots get it at once.
    assert targets(ElasticPolicy(idle_s=1.0).decide(snap(cell("r0", ROLLOUT, sessions=40), *fresh))) == {"t0": ROLLOUT}


def test_elastic_never_strands_work():
    # Never below one rollout cell (executions would have no engine) ...
    s = snap(cell("r0", ROLLOUT, sessions=1), cell("t0", TRAINER, train=7), backlog=70.0)
    assert ElasticPolicy().decide(s) == []
    # ... never below the trainer cells the ready training needs ...
    s = snap(cell("r0", ROLLOUT, sessions=40), cell("t0", TRAINER, train=1), cell("t1", TRAINER, train=1))
    assert ElasticPolicy(consolidate_batch=16).decide(s) == []
    # ... and a cell already moving is left alone (its role is the one it moves to).
    s = snap(cell("r0", ROLLOUT, sessions=2), cell("r1", TRAINER, moving=True), cell("r2", ROLLOUT),
             cell("t0", TRAINER, train=6), backlog=6.0)
    moves = ElasticPolicy().decide(s)
    assert "r1" not in targets(moves) and targets(moves) == {"r2": TRAINER}


def test_elastic_refills_a_pool_that_departing_cells_emptied():
    # The only rollout cell left the cluster while executions live: an idle trainer rolls out,
    # though no training work is ready and no cell has dwelt (three trainers, one is kept).
    s = snap(cell("t0", TRAINER, since=NOW), cell("t1", TRAINER, train=1, since=NOW), cell("t2", TRAINER, since=NOW),
             route_waiting=5)
    assert targets(ElasticPolicy(min_trainer=1).decide(s)) == {"t0": ROLLOUT}
    # The only trainer left: the rollout cell with the fewest live executions trains.
    s = snap(cell("r0", ROLLOUT, sessions=6), cell("r1", ROLLOUT, sessions=2), cell("r2", ROLLOUT, sessions=9))
    assert targets(ElasticPolicy().decide(s)) == {"r1": TRAINER}
    # A pool short only while the other is at its own minimum stays as it is.
    assert ElasticPolicy().decide(snap(cell("t0", TRAINER), route_waiting=5)) == []


def test_elastic_trainer_cells_roll_out_beyond_the_need():
    # 48 executions on one rollout cell; three trainer cells each hold one queued task (1 s each,
    # so 3 s ready, cleared in time by ceil(3 / 2 - 0.5) = 1 cell): two roll out, the queue follows.
    s = snap(cell("r0", ROLLOUT, sessions=48), *(cell(f"t{i}", TRAINER, queued=1) for i in range(3)))
    moves = ElasticPolicy(consolidate_batch=16, drain_s=2.0).decide(s)
    assert targets(moves) == {"t0": ROLLOUT, "t1": ROLLOUT}
    # Cells running a task go after those with only a queue (the task finishes there first).
    s = snap(cell("r0", ROLLOUT, sessions=48), cell("t0", TRAINER, train=1, queued=1), cell("t1", TRAINER, queued=1),
             cell("t2", TRAINER, train=1), backlog=3.0)
    assert targets(ElasticPolicy(consolidate_batch=16, drain_s=2.0).decide(s)) == {"t1": ROLLOUT, "t2": ROLLOUT}
    # Ready work that needs every trainer cell keeps them all.
    s = snap(*(cell(f"t{i}", TRAINER, queued=4) for i in range(3)), cell("r0", ROLLOUT, sessions=48))
    assert ElasticPolicy(consolidate_batch=16, drain_s=4.0).decide(s) == []


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
    from gyreflow.cluster.routing import RouteSnapshot, rebalance_sessions

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


def test_arrival_rate_counts_each_task_once_by_hand():
    import math

    from gyreflow.cluster.control import ArrivalRate

    r = ArrivalRate(window_s=100.0)
    assert r.update(0.0, {"a": 10.0}) == pytest.approx(0.1)  # 10 cell-s spread over the window
    # "a" still running: it does not arrive again; the rate decays over 10 s.
    assert r.update(10.0, {"a": 10.0}) == pytest.approx(0.1 * math.exp(-0.1))
    # "a" done, "b" (50 cell-s) arrives after 10 s more.
    expected = 0.1 * math.exp(-0.1) + (5.0 - 0.1 * math.exp(-0.1)) * (1 - math.exp(-0.1))
    assert r.update(20.0, {"b": 50.0}) == pytest.approx(expected)


def test_arrival_rate_converges_to_a_steady_rate():
    from gyreflow.cluster.control import ArrivalRate

    r = ArrivalRate(window_s=50.0)
    # Two cells' worth of work arriving: a 4 s task every 2 s, each running 6 s before it leaves.
    rate = 0.0
    for t in range(0, 1000, 2):
        live = {f"t{k}": 4.0 for k in range(max(0, t // 2 - 2), t // 2 + 1)}
        rate = r.update(float(t), live)
    assert rate == pytest.approx(2.0, rel=0.05)
