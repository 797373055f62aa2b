"""scripts/cluster.sh itself on the session's cluster: status reports every node, `up` again changes nothing
(the same daemons), and the nodes reach each other by name over ssh. `lose` and `revive` run in
test_node_loss.py; that `down` leaves nothing behind is checked when the session's fixture takes the cluster
down (conftest.leftovers)."""

import os

from conftest import NODES


def _pid(path):
    with open(path) as f:
        return int(f.read())


def test_status_and_up_again_is_idempotent(cluster):
    r = cluster.cluster("status")
    for k in range(1, NODES + 1):
        assert f"cluster: node{k} " in r.stdout and f"node{k} idle " in r.stdout, r.stdout
    assert "slurmd up, sshd up" in r.stdout and "DOWN" not in r.stdout, r.stdout
    before = (
        _pid(os.path.join(cluster.dir, "ctl", "slurmctld.pid")),
        _pid(os.path.join(cluster.dir, "nodes", "node1", "slurmd.pid")),
    )
    r = cluster.cluster("up", str(NODES))
    assert "already up" in r.stderr
    after = (
        _pid(os.path.join(cluster.dir, "ctl", "slurmctld.pid")),
        _pid(os.path.join(cluster.dir, "nodes", "node1", "slurmd.pid")),
    )
    assert after == before
    # The nodes resolve each other and reach each other over ssh with the generated key (pdsh's path).
    r = cluster.cluster("exec", "node1", "ssh", "node2", "hostname")
    assert r.stdout.strip() == "node2"
