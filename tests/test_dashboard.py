"""The gyreflow dashboard page, its state.json and the pools' Prometheus metrics, on a real cluster."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from distributed import Client, Nanny, Scheduler, SpecCluster

from gyreflow.cluster import dashboard
from gyreflow.cluster.cell import CellService
from gyreflow.cluster.plugin import PLUGIN_NAME, PoolsPlugin
from gyreflow.cluster.pools import ROLLOUT, TRAINER
from gyreflow.cluster.status import PoolsStatus

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from support import wait_for


def fetch(url: str, timeout: float = 10.0) -> tuple[int, str, str]:
    """Status, content type and body of a GET."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Content-Type", ""), err.read().decode()


def gyreflow_samples(base: str, scheduler: str) -> dict[tuple, float]:
    """``(metric, labels...) -> value`` of the gyreflow samples of one scheduler on ``/metrics``."""
    status, _, body = fetch(base + "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name.startswith("gyreflow_") and s.labels.get("scheduler") == scheduler:
                labels = tuple(v for k, v in sorted(s.labels.items()) if k != "scheduler")
                out[(s.name, *labels)] = s.value
    return out



@pytest.fixture(scope="module")
def cluster():
    """One rollout cell and one trainer cell (worker processes), a scheduler with a dashboard."""
    workers = {
        "rollout-0": {"cls": Nanny, "options": {"nthreads": 1, "resources": {ROLLOUT: 1}, "name": "rollout-0"}},
        "trainer-0": {"cls": Nanny, "options": {"nthreads": 1, "resources": {TRAINER: 1}, "name": "trainer-0"}},
    }
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": "127.0.0.1:0", "host": "127.0.0.1"}}
    with SpecCluster(workers=workers, scheduler=scheduler, name="gyreflow-test") as c, Client(c) as client:
        client.wait_for_workers(2)
        client.register_plugin(CellService())
        client.register_plugin(PoolsPlugin())
        link = dashboard.dashboard_link(client)
        assert link is not None and link.endswith("/gyreflow")
        base = link[: -len("/gyreflow")]
        info = client.sync(client.scheduler.identity, n_workers=-1)
        names = {w["name"]: addr for addr, w in info["workers"].items()}
        yield {"client": client, "base": base, "link": link, "scheduler": info["address"], "workers": names}


def test_page_is_served_and_linked(cluster):
    status, ctype, body = fetch(cluster["link"])
    assert status == 200 and ctype.startswith("text/html")
    assert "gyreflow" in body and "state.json" in body and "<svg" in body
    assert "http://" not in body and "https://" not in body  # self-contained: nothing fetched from elsewhere
    assert fetch(cluster["link"] + "/")[0] == 200
    pytest.importorskip("bokeh")
    status, _, body = fetch(cluster["base"] + "/status", timeout=20)
    assert status == 200 and 'href="gyreflow"' in body  # in the dashboard's "More..." menu


def test_state_json(cluster):
    rollout, trainer = cluster["workers"]["rollout-0"], cluster["workers"]["trainer-0"]
    status, ctype, body = fetch(cluster["link"] + "/state.json")
    assert status == 200 and ctype.startswith("application/json")
    state = json.loads(body)
    assert state["pools"] == {ROLLOUT: [rollout], TRAINER: [trainer]}
    assert state["mode"] == "async" and state["sessions"] == {rollout: 0}
    assert isinstance(state["history"], list) and isinstance(state["move_log"], list)

    def sampled():
        s = json.loads(fetch(cluster["link"] + "/state.json")[2])
        return s if s["history"] else None

    state = wait_for(sampled, what="a history sample")
    last = state["history"][-1]
    assert last[ROLLOUT] == 1 and last[TRAINER] == 1
    newer = json.loads(fetch(f"{cluster['link']}/state.json?since={last['time']}")[2])
    assert all(h["time"] > last["time"] for h in newer["history"])
    assert fetch(cluster["link"] + "/state.json?since=soon")[0] == 400


def test_metrics(cluster):
    rollout, trainer = cluster["workers"]["rollout-0"], cluster["workers"]["trainer-0"]
    m = gyreflow_samples(cluster["base"], cluster["scheduler"])
    assert m[("gyreflow_cells", ROLLOUT)] == 1 and m[("gyreflow_cells", TRAINER)] == 1
    assert m[("gyreflow_live_executions", rollout)] == 0
    assert m[("gyreflow_trainer_tasks", trainer)] == 0
    assert m[("gyreflow_placement_mode", "async")] == 1
    for name in ("gyreflow_cell_moves_total", "gyreflow_migrations_total", "gyreflow_migrated_bytes_total",
                 "gyreflow_idle_cell_seconds_total", "gyreflow_route_waiting", "gyreflow_cells_moving",
                 "gyreflow_trainer_tasks_waiting", "gyreflow_routed_total"):
        assert (name,) in m, name
    status, _, body = fetch(cluster["base"] + "/metrics")
    assert 'gyreflow_cells{pool="rollout"' in body


def test_role_change_shows_in_metrics(cluster):
    client, rollout = cluster["client"], cluster["workers"]["rollout-0"]

    async def set_role(addr, role, dask_scheduler=None):
        return await dask_scheduler.rpc(addr).gyreflow_set_role(role=role)

    def cells():
        m = gyreflow_samples(cluster["base"], cluster["scheduler"])
        return m[("gyreflow_cells", ROLLOUT)], m[("gyreflow_cells", TRAINER)]

    assert client.run_on_scheduler(set_role, rollout, TRAINER)["role"] == TRAINER
    try:
        wait_for(lambda: cells() == (0, 2), what="0 rollout / 2 trainer cells on /metrics")
        state = json.loads(fetch(cluster["link"] + "/state.json")[2])
        assert state["pools"][ROLLOUT] == [] and len(state["pools"][TRAINER]) == 2
    finally:
        assert client.run_on_scheduler(set_role, rollout, ROLLOUT)["role"] == ROLLOUT
    wait_for(lambda: cells() == (1, 1), what="the rollout cell back on /metrics")


def test_removed_plugin_leaves_page_and_metrics(cluster):
    client = cluster["client"]
    client.unregister_scheduler_plugin(PLUGIN_NAME)
    try:
        status, ctype, body = fetch(cluster["link"] + "/state.json")
        assert status == 503 and ctype.startswith("application/json") and "error" in json.loads(body)
        assert fetch(cluster["link"])[0] == 200  # the page stays, and says there is no data
        assert not gyreflow_samples(cluster["base"], cluster["scheduler"])
    finally:
        client.register_plugin(PoolsPlugin())
    assert fetch(cluster["link"] + "/state.json")[0] == 200
    m = gyreflow_samples(cluster["base"], cluster["scheduler"])
    assert m[("gyreflow_cells", ROLLOUT)] == 1 and m[("gyreflow_cells", TRAINER)] == 1


# ---------------------------------------------------------------------- without a cluster


class FakeScheduler:
    def __init__(self, address: str) -> None:
        self.address = address
        self.plugins: dict = {}
        self.unrunnable: dict = {}


class FakePlugin:
    """Stands in for a scheduler's PoolsPlugin: a status object, nothing else."""

    def __init__(self, scheduler: FakeScheduler, rollout: int) -> None:
        self.scheduler, self.rollout = scheduler, rollout
        scheduler.plugins["gyreflow-pools"] = self

    def status(self) -> PoolsStatus:
        cells = [f"tcp://r{i}" for i in range(self.rollout)]
        return PoolsStatus(time=1.0, wall=1.0, mode="elastic", pools={ROLLOUT: cells, TRAINER: ["tcp://t0"]}, moving=[],
                           sessions={c: 3 for c in cells}, train_tasks={"tcp://t0": 1}, train_waiting=0, route_waiting=2,
                           routed=5, moves=4, moves_failed=0, migrations=2, rebalanced_sessions=0, migrated_bytes=1024,
                           idle_cell_seconds=1.5, move_log=[], timeline=[], stalls=[])


def collected() -> dict[tuple, float]:
    out = {}
    for family in prometheus_client.REGISTRY.collect():
        for s in family.samples:
            if s.name.startswith("gyreflow_") and s.labels.get("scheduler", "").startswith("fake://"):
                out[(s.name, *(v for k, v in sorted(s.labels.items())))] = s.value
    return out


def test_metrics_of_several_schedulers_in_one_process():
    a, b = FakeScheduler("fake://a"), FakeScheduler("fake://b")
    pa, pb = FakePlugin(a, 2), FakePlugin(b, 3)
    for s, p in ((a, pa), (b, pb), (a, pa)):  # registering twice is harmless
        dashboard.register(s, p)
    try:
        m = collected()
        assert m[("gyreflow_cells", ROLLOUT, "fake://a")] == 2 and m[("gyreflow_cells", ROLLOUT, "fake://b")] == 3
        assert m[("gyreflow_live_executions", "tcp://r1", "fake://b")] == 3
        assert m[("gyreflow_route_waiting", "fake://a")] == 2
        assert m[("gyreflow_migrated_bytes_total", "fake://a")] == 1024
        dashboard.unregister(a, pa)
        assert not any(k[-1] == "fake://a" for k in collected())
        assert ("gyreflow_cells", TRAINER, "fake://b") in collected()
        with pytest.raises(LookupError):
            dashboard.state(a)
        assert dashboard.state(b)["mode"] == "elastic"
    finally:
        dashboard.unregister(a, pa)
        dashboard.unregister(b, pb)
    assert not collected()


def test_dashboard_link():
    class C:
        def __init__(self, link):
            self.dashboard_link = link

    assert dashboard.dashboard_link(C("http://h:8787/status")) == "http://h:8787/gyreflow"
    assert dashboard.dashboard_link(C("http://h/proxy/8787/status/")) == "http://h/proxy/8787/gyreflow"
    assert dashboard.dashboard_link(C("http://h:8787/status?token=x")) == "http://h:8787/gyreflow?token=x"
    assert dashboard.dashboard_link(C(None)) is None
