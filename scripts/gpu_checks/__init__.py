"""The checks `scripts/gpu_check.py` runs, one module each (issue 17, must-show 5).

Each module has `NAME` and `run(ctx) -> dict`: the figures of a passing check. A check that fails
raises (`report.CheckFailed` with its figures, or any error); one that cannot run here raises
`report.Skipped` with the reason. `report.run_check` times each and turns the outcome into a row.

    common.py          the run's settings (device, dtype, sizes), test models, the engine loop
    environment.py     GPU, driver, CUDA, torch, flash-attn
    kernels.py         flash-attn's two kernels against the torch reference, one inside a graph
    equality.py        engine greedy tokens against model.generate (long prompts, preemption, n > 1)
    graphs.py          graphs captured at warm-up, replayed while serving, equal to eager steps
    sampling.py        sampling on the device: temperature, top-k/p, min-p, seeds, bias, penalties, logprobs
    sync.py            no host sync inside decode steps but the sampled tokens' (sync debug mode)
    memory.py          the KV plan against the peak reserved at full load
    throughput.py      steady-state throughput of an 8B-shaped random Llama, engine build timed apart
    vllm_peer.py       the same workload on vLLM, in a venv of its own, when the registry's build installs
    serve.py           `cbserve serve` as the pod starts it, a streamed chat
    tensor_parallel.py two ranks against one (two GPUs, or two CPU ranks with --two-ranks)
    report.py          rows, the JSON and the markdown table
"""
