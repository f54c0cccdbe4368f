"""A simulated two-node cluster (ray.cluster_utils.Cluster, fake GPUs, CPU tensors)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _workers_helpers import assert_no_leaks, config, wait

from workers.cluster import check_feasible, describe
from workers.errors import Infeasible
from workers.gang import GangPool

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


@pytest.fixture
def two_nodes(_ray_shutdown_at_end: None) -> Iterator[object]:
    """Two raylets with 1 CPU and 2 fake GPUs each, in place of the session Ray (which the
    next test using `ray_session` starts again).
    """
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "num_gpus": 2, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=1, num_gpus=2)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_strict_spread_places_ranks_on_both_nodes(two_nodes: object) -> None:
    info = describe()
    assert len(info["nodes"]) == 2 and info["total_gpus"] == 4
    with pytest.raises(Infeasible, match=r"needs 3 distinct nodes .* 2 node\(s\) with a GPU"):
        check_feasible(
            config(
                world_size=3,
                batch_size=3,
                parallel="data",
                device="cuda",
                placement="strict_spread",
            )
        )
    pool = GangPool(placement_timeout_s=60)
    try:
        cfg = config(
            world_size=2,
            batch_size=2,
            parallel="data",
            device="cpu",
            placement="strict_spread",
            env={"NCCL_DEBUG": "WARN"},
        )
        outcome = wait(pool.start(cfg, "benchmark"), timeout_s=180)
        assert outcome.status == "succeeded", outcome.error
        nodes = [p.node_id for p in outcome.placement]
        assert len(set(nodes)) == 2
        where = [(p.node_ip, p.node_id) for p in outcome.placement]
        assert where == sorted(where)  # ranks ordered by node
        assert all(p.env_vars == {"NCCL_DEBUG": "WARN"} for p in outcome.placement)
        assert all(r.tokens_per_s > 0 and r.peak_memory_bytes > 0 for r in outcome.ranks)
    finally:
        pool.close()
    assert_no_leaks()
