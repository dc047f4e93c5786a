"""The scheduler's route table on its own (no cluster): engines without weights are routed
around until they announce them, and a late "no weights" answer cannot undo an announcement."""

import asyncio

from gyreflow.cluster.routes import RouteTable


def test_an_unready_answer_older_than_the_announcement_is_ignored():
    async def scenario():
        table = RouteTable(lambda: ("a", "b"), lambda: None)
        table.start()
        # "b" answered a call before it had weights: calls go around it ...
        table.release("s1", unready="b")
        assert table.engines() == ("a",)
        assert (await table.route("s2"))["engine"] == "a"
        # ... until it announces them.
        await table.ready("b")
        assert table.engines() == ("a", "b")
        # "a" announced first, and its answer from before its weights arrives only now: stale.
        await table.ready("a")
        table.release("s3", unready="a")
        assert table.engines() == ("a", "b")

    asyncio.run(scenario())


def test_sessions_of_a_worker_that_left_are_released():
    async def scenario():
        table = RouteTable(lambda: ("a",), lambda: None)
        table.start()
        await table.route("x1", caller="execution-0")
        await table.route("x2", caller="execution-1")
        await table.route("x3", caller="execution-0")
        assert sorted(table.forget_caller("execution-0")) == ["x1", "x3"]
        assert list(table.sessions) == ["x2"]  # only the live execution still counts
        table.release("x2")
        assert table.forget_caller("execution-1") == [] and not table.sessions

    asyncio.run(scenario())
