"""The surviving rank's error when a peer's node or process goes away names the lost rank and node, not only
the address gloo gives (run for real in tests/cluster/test_node_loss.py)."""

from aidaptiv_ds.job.failures import name_lost_peer

PEERS = [(0, "node1", "10.231.0.11"), (1, "node2", "10.231.0.12")]
GLOO = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[10.231.0.12]:47817: Connection reset by peer. This is typically caused by a remote worker hanging"
)


def test_names_the_rank_and_node_behind_the_address():
    assert name_lost_peer(GLOO, PEERS) == f"lost rank 1 on node2 (10.231.0.12): its node or process went away. {GLOO}"


def test_every_rank_on_a_shared_address():
    peers = [(0, "a", "127.0.0.1"), (1, "a", "127.0.0.1")]
    error = "RuntimeError: Connection closed by peer [127.0.0.1]:5000"
    assert name_lost_peer(error, peers).startswith("lost rank 0, rank 1 on a (127.0.0.1):")


def test_other_errors_and_unknown_addresses_unchanged():
    assert name_lost_peer("ValueError: bad [10.231.0.12]:1 value", PEERS) == "ValueError: bad [10.231.0.12]:1 value"
    assert name_lost_peer(GLOO.replace("10.231.0.12", "10.9.9.9"), PEERS) == GLOO.replace("10.231.0.12", "10.9.9.9")
    assert name_lost_peer(GLOO, None) == GLOO
    assert name_lost_peer(None, PEERS) is None
