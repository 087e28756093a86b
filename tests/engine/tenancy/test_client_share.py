"""The fair share of client work (tenancy/client_share.py), pure: what a tick takes of
each namespace's lanes, the budget the dear ones share in turn, the debt of a call larger
than the budget, and the ceiling."""

from __future__ import annotations

from loraplex_engine.tenancy.client_share import RECENT_S, ClientShare, Lanes, Work


def lane(ns: str, *costs: int, tag: str = "") -> list[Work[str]]:
    return [Work(ns, c, f"{ns}{tag}#{i}") for i, c in enumerate(costs)]


def tokens(taken: list[Work[str]], ns: str) -> int:
    return sum(w.cost for w in taken if w.namespace == ns)


def test_a_namespace_alone_takes_all_its_work_within_the_ceiling() -> None:
    share = ClientShare(ceiling=1000)
    lanes: Lanes[str] = {"a": [lane("a", 400, 400, 400), lane("a", 100, tag="s")]}
    taken = share.take(lanes, None, 0.0)
    # round-robin over lanes, stopping at the first item past the ceiling
    assert [w.item for w in taken] == ["a#0", "as#0", "a#1"]
    assert share.take({"a": [lane("a", 5000)]}, None, 0.0)[0].cost == 5000  # one, however big


def test_neighbours_of_one_size_run_in_lockstep() -> None:
    share = ClientShare(ceiling=10_000)
    lanes: Lanes[str] = {"a": [lane("a", 100)], "b": [lane("b", 120)]}
    assert {w.namespace for w in share.take(lanes, 110, 0.0)} == {"a", "b"}


def test_a_dear_namespace_gets_a_quarter_of_the_tokens_beside_a_small_one() -> None:
    """B steps 100 tokens a tick; A keeps 4 models' calls of 100 queued (demand 400): A
    is dear, its budget 100 // 3 a tick, so about one call every 3 ticks."""
    share = ClientShare(ceiling=10_000)
    a_tokens = 0
    ticks = 300
    for t in range(ticks):
        lanes: Lanes[str] = {
            "a": [lane("a", 100, tag=str(m)) for m in range(4)],
            "b": [lane("b", 100)],
        }
        taken = share.take(lanes, None, t * 0.01)
        assert tokens(taken, "b") == 100  # B every tick
        a_tokens += tokens(taken, "a")
    assert a_tokens <= ticks * (100 // 3) + 100, a_tokens
    assert a_tokens >= ticks * (100 // 3) - 100, a_tokens  # and A is not starved


def test_a_call_larger_than_the_budget_runs_alone_then_pays_its_debt() -> None:
    """An experiment's step costs 300 (the budget 100 a tick); A's calls are 10000 each:
    one runs in the first tick, the next after 100 ticks of paying it back."""
    share = ClientShare(ceiling=20_000)
    ran = []
    for t in range(250):
        taken = share.take({"a": [lane("a", 10_000, 10_000)]}, 300, t * 0.01)
        assert len(taken) <= 1
        if taken:
            ran.append(t)
    assert ran == [0, 100, 200], ran


def test_dear_namespaces_share_one_budget_in_turn_resuming_where_it_stopped() -> None:
    """Three dear namespaces (Sybils of one tenant, say) share the one budget: together
    they get what one would, each in turn."""
    share = ClientShare(ceiling=20_000)
    order = []
    for t in range(60):
        lanes: Lanes[str] = {ns: [lane(ns, 300, 300)] for ns in ("x", "y", "z")}
        taken = share.take(lanes, 90, t * 0.01)  # budget 30 a tick: one call per 10
        order += [w.namespace for w in taken]
    assert order == ["x", "y", "z", "x", "y", "z"], order


def test_a_co_tenant_between_calls_still_counts_and_nothing_runs_on_credit_alone() -> None:
    """B's client was served and is sending its next call (not queued yet): A stays dear,
    and a tick in which no co-tenant runs takes none of A's calls (its debt is paid only
    by ticks a co-tenant ran in)."""
    share = ClientShare(ceiling=20_000)
    a = {"a": [lane("a", 1000, 1000)]}
    assert tokens(share.take({**a, "b": [lane("b", 100)]}, None, 0.0), "a") == 1000
    assert share.take(a, None, 0.1) == []  # B between calls: A waits
    assert not share.plan(a, None, 0.2).taken
    # B gone for longer than RECENT_S: A is alone, and runs. The share says when, so an
    # idle engine looks again then (Engine._wake_when_the_share_settles), not a poll later.
    settles = share.settles_at(0.2)
    assert settles is not None and RECENT_S < settles <= RECENT_S + 0.01, settles
    assert not share.plan(a, None, RECENT_S).taken  # the window's last instant: still B's
    assert tokens(share.take(a, None, settles), "a") == 2000
    assert share.settles_at(settles + RECENT_S + 0.01) is None  # nobody recent: no wake-up


def test_a_lane_is_taken_as_a_prefix() -> None:
    share = ClientShare(ceiling=250)
    taken = share.take({"a": [lane("a", 100, 100, 100)]}, None, 0.0)
    assert [w.item for w in taken] == ["a#0", "a#1"]


def test_a_co_tenant_with_only_its_optim_step_queued_still_sets_the_pace() -> None:
    """B's forward_backward ran last tick and only its optim_step (cost 0) is queued: B
    still counts at the demand it was served at, so A stays dear."""
    share = ClientShare(ceiling=20_000)
    a = {"a": [lane("a", 31, tag=str(m)) for m in range(4)]}
    share.take({**a, "b": [lane("b", 6)]}, None, 0.0)
    taken = share.take({**a, "b": [lane("b", 0)]}, None, 0.01)
    assert [w.namespace for w in taken] == ["b"]


def test_an_optim_step_sets_no_size_so_equal_clients_stay_in_lockstep() -> None:
    """A and B train one row each (95 tokens a forward_backward, 64 more its optim_step):
    A's optim_steps miss their ticks and wait queued alone, B's come with its calls. Sized
    by their training calls (an optim_step's ``pace`` 0), neither is dear: B runs every
    tick. Sized by cost (as before), A's lone 64 made B dear beside it: B ran once, then
    paid its debt for ticks (a third of 64 a tick) while its calls waited."""
    lanes: Lanes[str] = {
        "a": [[Work("a", 64, "a:optim_step", pace=0)]],
        "b": [[Work("b", 159, "b:forward_backward+optim_step", pace=95)]],
    }
    by_cost: Lanes[str] = {ns: [[Work(ns, w.cost, w.item)]] for ns, [[w]] in lanes.items()}
    for queued, b_ran in ((lanes, 5), (by_cost, 1)):
        share = ClientShare(ceiling=20_000)
        ticks = [share.take(queued, None, t * 0.01) for t in range(5)]
        assert sum(tokens(taken, "b") > 0 for taken in ticks) == b_ran
