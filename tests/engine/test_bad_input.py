"""Bad input gets a clear error at add_request; the loop and the other requests are unharmed."""

from __future__ import annotations

import pytest

from engine import ContinuousBatchingConfig, ContinuousBatchingManager, QueueFullError, generate_batch
from tests.engine.conftest import VOCAB, model_for

BAD_REQUESTS = [
    (dict(input_ids=[]), "prompt is empty"),
    (dict(input_ids=[1, VOCAB]), "not a token id"),
    (dict(input_ids=[1, -1]), "not a token id"),
    (dict(input_ids=[1, "a"]), "not a token id"),
    (dict(input_ids=[1, 2], max_new_tokens=0), "max_new_tokens must be a positive integer"),
    (dict(input_ids=[1, 2], max_new_tokens=-3), "max_new_tokens must be a positive integer"),
    (dict(input_ids=[1] * 5000), "context"),
    (dict(input_ids=[1, 2], max_new_tokens=100_000), "exceeds the KV cache capacity"),
    (dict(input_ids=[1, 2], temperature=-1.0), "temperature"),
    (dict(input_ids=[1, 2], top_p=0.0), "top_p"),
    (dict(input_ids=[1, 2], top_p=1.5), "top_p"),
    (dict(input_ids=[1, 2], top_k=-1), "top_k"),
    (dict(input_ids=[1, 2], logprobs=99), "logprobs"),
    (dict(input_ids=[1, 2], logit_bias={VOCAB + 1: 1.0}), "logit_bias"),
    (dict(input_ids=[1, 2], no_such_knob=1), "unknown sampling parameter"),
]


@pytest.fixture(scope="module")
def manager():
    mgr = ContinuousBatchingManager(
        model_for("llama"), continuous_batching_config=ContinuousBatchingConfig(block_size=16, num_blocks=64, max_queue_size=4)
    )
    mgr.start()
    yield mgr
    mgr.stop(timeout=30)


@pytest.mark.parametrize("kwargs,message", BAD_REQUESTS, ids=[m for _, m in BAD_REQUESTS])
def test_bad_request_is_refused_with_a_clear_error(manager, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        manager.add_request(**kwargs)
    # the loop is alive and serves the next request
    rid = manager.add_request([1, 2, 3], max_new_tokens=2, ignore_eos=True)
    assert manager.get_result(rid, timeout=60).finish_reason == "length"


def test_duplicate_request_id_is_refused(manager) -> None:
    manager.add_request([1, 2, 3], request_id="dup", max_new_tokens=50, ignore_eos=True)
    with pytest.raises(ValueError, match="already in use"):
        manager.add_request([4, 5, 6], request_id="dup")
    assert len(list(manager.request_id_iter("dup"))[-1].generated_tokens) == 50


def test_full_queue_refuses_with_queue_full_error() -> None:
    mgr = ContinuousBatchingManager(
        model_for("llama"), continuous_batching_config=ContinuousBatchingConfig(block_size=16, num_blocks=64, max_queue_size=2)
    )  # not started: nothing leaves the queue
    mgr.add_request([1, 2])
    mgr.add_request([1, 2])
    with pytest.raises(QueueFullError):
        mgr.add_request([1, 2])
    mgr.stop(hard_stop=True)


def test_generate_batch_fails_only_the_bad_prompt() -> None:
    out = generate_batch(model_for("llama"), [[1, 2, 3], [], [4, 5, VOCAB + 7]], max_new_tokens=4, ignore_eos=True,
                         progress_bar=False, continuous_batching_config=ContinuousBatchingConfig(block_size=16, num_blocks=64))
    assert out["req_0"].error is None and len(out["req_0"].generated_tokens) == 4
    assert "empty" in out["req_1"].error and out["req_1"].finish_reason == "error"
    assert "not a token id" in out["req_2"].error


@pytest.mark.parametrize(
    "field,value",
    [("block_size", 24), ("block_size", 0), ("num_blocks", -1), ("max_batch_tokens", 0), ("max_memory_percent", 1.5),
     ("max_memory_percent", 0), ("scheduler_type", "lifo"), ("cpu_offload_space", -1), ("max_queue_size", -1),
     ("use_cuda_graph", "yes"), ("allow_block_sharing", "no"), ("attn_backend", "tpu"),
     ("cpu_offload_space_safety_threshold", 1.5), ("q_padding_interval_size", -1), ("drop_unsupported_processors", 1)],
)
def test_config_errors_name_the_field(field, value) -> None:
    with pytest.raises(ValueError, match=field):
        ContinuousBatchingConfig(**{field: value})


def test_every_field_of_transformers_config_is_accepted_with_its_meaning() -> None:
    """The fields transformers' ContinuousBatchingConfig has and cbserve's lacked (each raised
    TypeError): accepted; their meanings where cbserve has one, a warning where they are gone."""
    import warnings

    import psutil

    from engine import LLMEngine

    cfg = ContinuousBatchingConfig(max_blocks_per_request=0, max_memory_percent=None, q_padding_interval_size=64,
                                   kv_padding_interval_size=256, drop_unsupported_processors=False)  # fmt: skip
    assert cfg.max_blocks_per_request is None and cfg.max_memory_percent == 0.9  # 0: no cap; None: 0.9
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ContinuousBatchingConfig(max_cached_graphs=8, use_default_compile_configs=True)
    assert [w.category for w in caught] == [FutureWarning, FutureWarning]
    total_gib = psutil.virtual_memory().total / (1 << 30)
    engine = LLMEngine(model_for("llama"), ContinuousBatchingConfig(block_size=16, num_blocks=32,
                       cpu_offload_space=total_gib, cpu_offload_space_safety_threshold=0.01))  # fmt: skip
    assert engine.swap is not None
    assert engine.swap.capacity_blocks * engine.sizes.bytes_per_block <= 0.01 * total_gib * (1 << 30)


def test_config_from_dict_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="unknown engine setting 'blocksize'"):
        ContinuousBatchingConfig.from_dict({"blocksize": 16})
    assert ContinuousBatchingConfig.from_dict({"page_size": 32}).block_size == 32


def test_start_up_logs_the_sizes_it_chose(caplog) -> None:
    import logging

    from engine import LLMEngine

    with caplog.at_level(logging.INFO, logger="cbserve.engine"):
        engine = LLMEngine(model_for("llama"), ContinuousBatchingConfig(block_size=16, max_memory_percent=0.5))
    line = next(r.getMessage() for r in caplog.records if "KV cache" in r.getMessage())
    assert f"{engine.sizes.num_blocks} blocks x 16 tokens" in line
    assert "max_batch_tokens 1024" in line
    assert engine.sizes.cache_bytes <= 1 << 30  # the CPU cap
