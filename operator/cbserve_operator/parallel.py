"""The tensor-parallel flags of the engine's command lines, from `resources.gpu` and `resources.nodes`.

One pod with N GPUs: `--tensor-parallel-size N` (none for one GPU or the CPU). A group of M pods
(a LeaderWorkerSet, group.py) with N GPUs each is one engine of world size T = N x M: every pod gets
`--tensor-parallel-size T --nnodes M`, the address of the group's leader (rank 0, which hosts the
torch.distributed store on DIST_PORT) and, on the workers, their place in the group. Both come
from the variables LeaderWorkerSet's pod webhook puts in every container of a group, expanded by
the kubelet (`$(VAR)` in a command).
"""

from __future__ import annotations

from .spec import CBDeploymentSpec

DIST_PORT = 29500  # the leader's torch.distributed TCP store (torch's usual port)
LEADER_ADDRESS = "$(LWS_LEADER_ADDRESS)"  # <lws>-<group>.<headless service>.<namespace>
WORKER_INDEX = "$(LWS_WORKER_INDEX)"  # 0 on the leader, 1..M-1 on the workers


def serve_flags(spec: CBDeploymentSpec) -> list[str]:
    """What `cbserve serve` gets: the pod's tensor-parallel size, or the group's leader flags."""
    if spec.multi_node:
        return [*_group_flags(spec), "--dist-addr", LEADER_ADDRESS, "--dist-port", str(DIST_PORT)]
    return ["--tensor-parallel-size", str(spec.resources.gpu)] if spec.resources.gpu > 1 else []


def worker_flags(spec: CBDeploymentSpec) -> list[str]:
    """What `cbserve worker` gets: the group's flags and this pod's rank among the pods."""
    return [*_group_flags(spec), "--node-rank", WORKER_INDEX, "--dist-addr", LEADER_ADDRESS,
            "--dist-port", str(DIST_PORT)]  # fmt: skip


def _group_flags(spec: CBDeploymentSpec) -> list[str]:
    return ["--tensor-parallel-size", str(spec.world_size), "--nnodes", str(spec.resources.nodes)]
