"""The checks `scripts/gpu_check.py` runs, one module each (issue 17, must-show 5).

Each module has `NAME`, `TIMEOUT_S` (its limit; scripts/gpu_check.py runs each in a process of its
own) and `run(ctx) -> dict`: the figures of a passing check; some have `requirement(ctx)`, the reason
the row cannot run here, asked before its process starts. A check that fails raises
(`report.CheckFailed` with its figures, or any error); one that cannot run here raises
`report.Skipped` with the reason. `report.run_check` times each and turns the outcome into a row.

    common.py          the run's settings (device, dtype, sizes), test models, the engine loop
    environment.py     GPU, driver, CUDA, torch, transformers, flash-attn, the attention backend
    kernels.py         the CUDA attention backend against the torch reference, one call inside a graph
    equality.py        engine greedy tokens against the model, teacher-forced (long prompts, preemption, n > 1)
    graphs.py          graphs captured at warm-up, replayed while serving, equal to eager steps
    sampling.py        sampling on the device: temperature, top-k/p, min-p, seeds, bias, penalties, logprobs
    sync.py            no host sync inside decode steps but the sampled tokens' (sync debug mode)
    serve.py           `cbserve serve` as the pod starts it, a streamed chat
    memory.py          the peak reserved at full load within the KV plan
    throughput.py      throughput of an 8B-shaped random Llama; a batch-1 decode step against bandwidth
    transformers_peer.py  the same workload on transformers' own generate_batch
    vllm_peer.py       the same workload on vLLM, when a Python with vLLM is at hand
    tensor_parallel.py two ranks against one (two GPUs, or two CPU ranks with --two-ranks)
    report.py          rows, the JSON and the markdown table
"""
