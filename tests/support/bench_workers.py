"""Stand-in ranks for graphcap.bench.tp's spawning (imported by name in new processes)."""


def large_result(rank: int, size: int, init: str, job: dict, queue) -> None:
    """Rank 0 sends ``job["bytes"]`` bytes of results, more than a pipe holds."""
    if rank == 0:
        queue.put([{"model": "x" * job["bytes"]}])
