"""How Muon's matrices are shared between the ranks (utils/training/optim/muon.py does the work): what
orthogonalising a matrix costs, which rank owns each matrix, the order and buckets they are done in, and what a
rank holds while it does them. Torch-free: the memory plan (configs/profiles.py) reads it too."""
from __future__ import annotations

# Across ranks, the most values (of whole matrices) one exchange of updates carries: 64 MiB in fp32. The demo
# model's matrices all fit in one (two collectives a step under FSDP); the 1.2B's 8192 x 2048 ones go a
# round at a time (on 2 ranks 2 x 16.8M values).
BUCKET_VALUES = 2**24


def newton_schulz_flops(shape: tuple[int, ...], ns_steps: int = 5) -> int:
    """FLOPs of orthogonalising one matrix of `shape` (m <= n after the transpose): per step the Gram matrix
    (2 m^2 n), its square (2 m^3) and the update (2 m^2 n); torch's Muon takes 5 steps."""
    m, n = sorted(shape[:2])
    return ns_steps * (4 * m * m * n + 2 * m ** 3)


def assign_by_cost(costs: list[int], world: int) -> list[int]:
    """Each matrix's owner among `world` ranks, by Newton-Schulz cost: the costliest first (ties: the earlier
    matrix), each to the rank with the least work so far (ties: the lower rank), the longest-processing-time
    rule: the busiest rank does at most 4/3 of the optimum's work. Every rank computes the same answer."""
    load, owners = [0] * world, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[i], load[rank] = rank, load[rank] + costs[i]
    return owners


def buckets_of(owners: list[int], costs: list[int], sizes: list[int], world: int,
               limit: int | None = None) -> list[list[list[int]]]:
    """The order the matrices are done in, as buckets of each rank's matrices (`bucket[rank]`, a list). Round i
    holds each rank's i-th matrix (its costliest first), so a round's owners work at once on matrices alike in
    cost; consecutive rounds share a bucket while its matrices hold at most `limit` values together (`sizes`),
    and one bucket's updates travel in one collective each way: few collectives for small matrices, a
    bounded transient for large ones. A round is never split."""
    limit = BUCKET_VALUES if limit is None else limit
    mine = [sorted((i for i, o in enumerate(owners) if o == r), key=lambda i: (-costs[i], i)) for r in range(world)]
    buckets, values = [], limit
    for i in range(max(map(len, mine), default=0)):
        round_ = [m[i:i + 1] for m in mine]
        size = sum(sizes[j] for r in round_ for j in r)
        if values + size > limit:
            buckets.append([[] for _ in range(world)])
            values = 0
        for rank, matrices in enumerate(round_):
            buckets[-1][rank] += matrices
        values += size
    return buckets


def work_per_rank(shapes: list[tuple[int, int]], world: int) -> list[int]:
    """Each rank's Newton-Schulz FLOPs per step for matrices of `shapes` shared by `world` ranks."""
    costs = [newton_schulz_flops(shape) for shape in shapes]
    load = [0] * world
    for owner, cost in zip(assign_by_cost(costs, world), costs):
        load[owner] += cost
    return load


def step_bytes(shapes: list[tuple[int, int]], strategy: str, world: int, ns_bytes: int = 2,
               update_bytes: int = 4) -> int:
    """The most a rank holds at once in Muon's step beyond its state, bucket by bucket (muon.py's _Work):
    Newton-Schulz's workspace for one matrix (its copy, the iterate, the Gram matrix and its polynomial, in
    `ns_bytes`) and, one process, that matrix's update (`update_bytes`, the gradients' dtype); DDP, the updates
    of the rank's own matrices and every result of the bucket; FSDP, its rows of the bucket's updates and the
    copy it sends, its owned matrices whole, their results and the rows it sends back, and the rows it gets."""
    sizes = [rows * cols for rows, cols in shapes]
    costs = [newton_schulz_flops(shape) for shape in shapes]
    owners = assign_by_cost(costs, world)
    buckets = [[[i]] for i in range(len(shapes))] if world == 1 else buckets_of(owners, costs, sizes, world)
    peak = 0
    for bucket in buckets:
        every = sum(sizes[i] for matrices in bucket for i in matrices)
        for mine in bucket:
            owned = sum(sizes[i] for i in mine)
            workspace = max((ns_bytes * (2 * sizes[i] + 2 * min(shapes[i]) ** 2) for i in mine), default=0)
            if world == 1:
                held = update_bytes * owned
            elif strategy == "fsdp":
                held = (update_bytes + 2 * ns_bytes) * every // world + 3 * ns_bytes * owned
            else:
                held = update_bytes * owned + ns_bytes * every
            peak = max(peak, held + workspace)
    return peak
