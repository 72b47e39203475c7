"""psring.predict.sim.engine.Flows: connections sharing links as a fluid, worked by hand."""

import pytest

from psring.predict.sim.engine import Events, Flows, Link

MB = 1e6


def net(spread=0.0, seed=0):
    ev = Events()
    return ev, Flows(ev, spread, seed)


def test_two_connections_on_one_link_share_it_and_finish_together():
    ev, flows = net()
    link = Link("link", 1 / (100 * MB))  # 100 MB/s
    a, b = flows.connection([link], 0.001), flows.connection([link], 0.001)
    got = {}
    flows.mark(0.0)
    a.send(0.0, 10 * MB, lambda t: got.setdefault("a", t))
    b.send(0.0, 10 * MB, lambda t: got.setdefault("b", t))
    for t in (0.1, 0.2, 1.0):
        ev.at(t, flows.mark)
    ev.run()
    # 20 MB through 100 MB/s: both done at 0.2 s, arriving α later
    assert got["a"] == pytest.approx(0.201)
    assert got["b"] == pytest.approx(0.201)
    assert flows.busy(link, 0.0, 0.1) == pytest.approx(0.1)
    assert flows.busy(link, 0.0, 0.2) == pytest.approx(0.2)
    assert flows.busy(link, 0.2, 1.0) == pytest.approx(0.0)


def test_a_connection_is_fifo_and_an_empty_message_arrives_behind_the_bytes():
    ev, flows = net()
    c = flows.connection([Link("link", 1 / (100 * MB))], 0.0)
    order = []
    c.send(0.0, 10 * MB, lambda t: order.append(("push", t)))
    c.send(0.0, 0.0, lambda t: order.append(("pull", t)))
    ev.run()
    assert [k for k, _ in order] == ["push", "pull"]
    assert order[1][1] == pytest.approx(0.1)


def test_a_connection_held_back_elsewhere_leaves_its_share_to_the_others():
    # a and b share link 1 (100 MB/s); b also crosses link 2 (20 MB/s), which holds it
    # to 20 MB/s, so a gets the other 80 MB/s of link 1, not half of it
    ev, flows = net()
    one, two = Link("one", 1 / (100 * MB)), Link("two", 1 / (20 * MB))
    a, b = flows.connection([one], 0.0), flows.connection([one, two], 0.0)
    got = {}
    a.send(0.0, 8 * MB, lambda t: got.setdefault("a", t))
    b.send(0.0, 4 * MB, lambda t: got.setdefault("b", t))
    ev.run()
    assert got["a"] == pytest.approx(0.1)  # 8 MB at 80 MB/s
    assert got["b"] == pytest.approx(0.2)  # 4 MB at 20 MB/s


def test_a_later_flow_slows_an_earlier_one_as_tcp_s_would():
    # FIFO on the link would finish a at 0.1 s; shared, b takes half from 0.05 s on
    ev, flows = net()
    link = Link("link", 1 / (100 * MB))
    a, b = flows.connection([link], 0.0), flows.connection([link], 0.0)
    got = {}
    a.send(0.0, 10 * MB, lambda t: got.setdefault("a", t))
    ev.at(0.05, lambda t: b.send(t, 10 * MB, lambda tt: got.setdefault("b", tt)))
    ev.run()
    assert got["a"] == pytest.approx(0.15)  # 5 MB alone, 5 MB at half the rate
    assert got["b"] == pytest.approx(0.2)


def test_uneven_weights_finish_apart_but_the_link_stays_full():
    ev, flows = net(spread=0.5, seed=3)
    link = Link("link", 1 / (100 * MB))
    got = []
    for _ in range(4):
        flows.connection([link], 0.0).send(0.0, 10 * MB, got.append)
    ev.run()
    assert len(got) == 4
    assert max(got) == pytest.approx(0.4)  # work conserving: 40 MB at 100 MB/s
    assert min(got) < 0.39  # someone got more than a quarter
