"""Placing a process's CUDA device ordinal on its NVML GPU (aggregator.gpu_identity), with
NVML device records as the nvml probe writes them (gpu_index, gpu_uuid, gpu_name,
processes)."""
from ridgeline.aggregator import gpu_identity as gi

U = [f"GPU-{i}a5c7c3b4-0000-1111-2222-33334444555{i}" for i in range(4)]


def nvml(procs_by_index, known=True):
    def procs(i):
        return [{"pid": p, "gpu_memory_used_bytes": 1} for p in procs_by_index.get(i, [])] if known else None
    return [{"gpu_index": i, "gpu_uuid": U[i], "gpu_name": "NVIDIA H100 80GB HBM3", "processes": procs(i)}
            for i in range(4)]


def test_process_lists_by_pid():
    placed = gi.process_gpus(nvml({1: [100], 3: [100, 200]}))
    assert placed == {100: [(1, U[1], "NVIDIA H100 80GB HBM3"), (3, U[3], "NVIDIA H100 80GB HBM3")],
                      200: [(3, U[3], "NVIDIA H100 80GB HBM3")]}
    assert gi.process_gpus(nvml({}, known=False)) is None          # NVML did not say: unknown, not empty
    assert gi.process_gpus([]) is None


def test_one_gpu_per_process_is_placed_whatever_its_ordinal():
    # CUDA_VISIBLE_DEVICES=3, or a pod given node GPU 3: the process calls it device 0.
    placed = gi.process_gpus(nvml({3: [200], 2: [300]}))
    assert gi.place(200, [0], placed) == {0: (3, U[3], "NVIDIA H100 80GB HBM3")}
    assert gi.place(300, {0}, placed)[0][0] == 2


def test_several_gpus_identity_only_when_the_ordinals_are_their_indices():
    placed = gi.process_gpus(nvml({0: [100], 1: [100], 2: [400], 3: [400]}))
    assert {o: g[0] for o, g in gi.place(100, [0, 1], placed).items()} == {0: 0, 1: 1}
    assert {o: g[0] for o, g in gi.place(100, [1], placed).items()} == {1: 1}
    # CUDA_VISIBLE_DEVICES=2,3: ordinals 0 and 1 on GPUs 2 and 3, order not provable: unknown.
    assert gi.place(400, [0, 1], placed) == {}
    # Not listed by NVML (another pid namespace, exited): unknown, never the ordinal's GPU.
    assert gi.place(999, [0], placed) == {}
