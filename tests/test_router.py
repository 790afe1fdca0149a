"""The router's waiting rules, on its own loop: requests that wait on a model whose engine is taken away ask for
it to be loaded again, and requests that wait for another engine than the active one do not hold up a swap."""

from __future__ import annotations

import asyncio

from desktop.core.serving.router import Route, Router, Upstream


def upstream(name: str) -> Upstream:
    return Upstream(name, "llama.cpp", f"http+unix://%2Ftmp%2F{name}.sock", "m")


def fleet_router() -> tuple[Router, list[str]]:
    asked: list[str] = []
    router = Router({"waited": 0})
    router.routes = {"alpha": Route(), "beta": Route()}
    router.on_demand = asked.append
    router.bind()
    return router, asked


def test_requests_waiting_on_a_model_that_goes_idle_ask_for_its_load() -> None:
    """A request that failed twice on alpha's engine waits for another one; alpha is then swapped out (idle).
    Nobody else asks for alpha: the waiting request itself must, or it waits until its deadline (a 503)."""

    async def scenario() -> None:
        router, asked = fleet_router()
        first, second = upstream("alpha-1"), upstream("alpha-2")
        await router.set_upstream(first, None, "alpha")
        loop = asyncio.get_running_loop()
        waiting = asyncio.ensure_future(router.acquire(loop.time() + 30, avoid=first, route=router.routes["alpha"],
                                                       model="alpha"))
        while router.routes["alpha"].waiting == 0:
            await asyncio.sleep(0)  # let it start waiting (no time passes: the loop runs it)
        await router.set_upstream(None, None, "alpha", idle=True)  # swapped out to make room for beta
        assert asked == ["alpha"], "the waiting request did not ask for alpha's engine"
        assert not router.routes["alpha"].idle  # asked once: the next arrival does not ask again
        await router.set_upstream(second, None, "alpha")
        assert await asyncio.wait_for(waiting, 5) is second

    asyncio.run(scenario())


def test_settle_does_not_wait_for_requests_that_avoid_the_active_engine() -> None:
    """Before a swap takes alpha's engine away, the endpoint lets in the requests that waited for its load
    (settle). One that waits for a different engine can never be let in: settle must not wait for it."""

    async def scenario() -> None:
        router, _asked = fleet_router()
        active = upstream("alpha-1")
        await router.set_upstream(active, None, "alpha")
        loop = asyncio.get_running_loop()
        waiting = asyncio.ensure_future(router.acquire(loop.time() + 30, avoid=active, route=router.routes["alpha"],
                                                       model="alpha"))
        while router.routes["alpha"].waiting == 0:
            await asyncio.sleep(0)
        assert await router.settle("alpha", 0.5)  # at once, not after its timeout
        assert router.routes["alpha"].avoiding == {"alpha-1": 1}
        waiting.cancel()
        while router.routes["alpha"].waiting:
            await asyncio.sleep(0)
        assert router.routes["alpha"].avoiding == {}

    asyncio.run(scenario())
