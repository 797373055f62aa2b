"""The surviving rank's error when a peer's node or process goes away names the lost rank and node, not only
the address gloo gives (run for real in tests/cluster/test_node_loss.py)."""

from aidaptiv_ds.job.failures import explain_peer_failure, name_lost_peer

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


GLOO_TIMEOUT = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
    "waiting 20000ms for recv operation to complete"
)
NCCL_TIMEOUT = (
    "DistBackendError: [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, "
    "OpType=_ALLGATHER_BASE, NumelIn=8, NumelOut=16, Timeout(ms)=20000) ran for 20001 milliseconds before timing out."
)


def test_a_silent_peer_is_said_with_the_wait_and_the_ranks_waited_for():
    # A cut link or a frozen node: the collective times out (train's --peer-timeout) and names nobody.
    three = PEERS + [(2, "node3", "10.231.0.13")]
    for error in (GLOO_TIMEOUT, NCCL_TIMEOUT):
        said = explain_peer_failure(error, three, rank=0, timeout_s=20)
        assert said == (
            "no answer from the other ranks for 20 s (`peer_timeout`): one of them, its node or the link to it went "
            "away (rank 1 on node2 (10.231.0.12), rank 2 on node3 (10.231.0.13)); check those nodes, then resume "
            f"from the last checkpoint. {error}"
        )


def test_explain_names_a_broken_connection_and_leaves_other_errors():
    assert explain_peer_failure(GLOO, PEERS, rank=0, timeout_s=600) == name_lost_peer(GLOO, PEERS)
    assert explain_peer_failure("ValueError: bad value", PEERS, rank=0, timeout_s=600) == "ValueError: bad value"
    assert explain_peer_failure(GLOO_TIMEOUT, None, rank=0, timeout_s=600) == GLOO_TIMEOUT  # one process
