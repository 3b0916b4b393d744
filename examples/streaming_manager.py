"""Stream tokens from the background manager while other requests run (the serving pattern).

    python examples/streaming_manager.py
"""

from __future__ import annotations

from engine import ContinuousBatchingConfig, ContinuousBatchingManager
from engine.testing import build_test_model, build_test_tokenizer


def main() -> None:
    model, tokenizer = build_test_model("llama"), build_test_tokenizer()
    manager = ContinuousBatchingManager(model, continuous_batching_config=ContinuousBatchingConfig(block_size=16))
    manager.warmup()
    manager.start()
    try:
        background = [manager.add_request(tokenizer(f"Request {i}:").input_ids, max_new_tokens=40) for i in range(8)]
        rid = manager.add_request(tokenizer("Once upon a time").input_ids, max_new_tokens=24, streaming=True,
                                  temperature=0.8, seed=0)
        for out in manager.request_id_iter(rid):
            print(tokenizer.decode(out.new_tokens), end="", flush=True)
        print(f"\n[{out.finish_reason}] {len(out.generated_tokens)} tokens")
        for b in background:
            manager.get_result(b, timeout=60)
    finally:
        manager.stop()


if __name__ == "__main__":
    main()
