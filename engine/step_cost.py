"""`StepCostModel`: a step's wall time predicted from what it carries, fitted to the steps the engine
measures, so the scheduler can cap prompt chunks next to running decodes (`max_decode_stall`) with no
tuning per host or model.

    seconds ~ a + b * decode_rows + c * prefill_tokens + e * [prefill_tokens > 0]

`a` is the fixed cost of a step (Python, dispatch, sampling), `b` a decode row's, `c` a prompt token's
and `e` what a step with prompt tokens costs beyond that (another attention path). The fit is least
squares of the relative error over the last `window` steps without prompt tokens and, kept apart so a
long stretch of decodes does not forget what prompts cost, the last `window` steps with them. A step
that is slower than the line (a cold kernel, another process on the core) weighs less the slower it is.
Once fitted, the line is fitted again every REFIT_EVERY steps, not every step: the fit (numpy's lstsq) takes
0.25 ms when the step's weights have just pushed its code and data out of the caches, 1% of a 16-row
decode step of SmolLM2, and the line moves slowly.
"""

from __future__ import annotations

from collections import deque

import numpy as np

WINDOW = 64
MIN_SAMPLES = 4  # of each kind, before the model predicts anything
REFIT_EVERY = 8  # steps observed between two fits, once fitted


class StepCostModel:
    def __init__(self, window: int = WINDOW) -> None:
        self._decode: deque[tuple[int, int, float]] = deque(maxlen=window)  # steps without prompt tokens
        self._prefill: deque[tuple[int, int, float]] = deque(maxlen=window)  # steps with some
        self._coef: tuple[float, float, float, float] | None = None
        self._unfitted = 0  # steps observed since the last fit

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        """One measured step: its single-token rows, its tokens in longer rows, its wall time."""
        if seconds <= 0 or decode_rows + prefill_tokens == 0:
            return
        (self._prefill if prefill_tokens else self._decode).append((decode_rows, prefill_tokens, seconds))
        self._unfitted += 1

    def coefficients(self) -> tuple[float, float, float, float] | None:
        """(a, b, c, e), or None until both kinds of step have been seen MIN_SAMPLES times; fitted on the
        steps seen up to at most REFIT_EVERY - 1 steps ago."""
        if self._unfitted and (self._coef is None or self._unfitted >= REFIT_EVERY):
            self._coef, self._unfitted = self._fit(), 0
        return self._coef

    def _fit(self) -> tuple[float, float, float, float] | None:
        if len(self._decode) < MIN_SAMPLES or len(self._prefill) < MIN_SAMPLES:
            return None
        d, p, y = np.array([*self._decode, *self._prefill], dtype=np.float64).T
        x = np.stack([np.ones_like(d), d, p, (p > 0).astype(np.float64)], axis=1)
        # minimise sum(((x @ coef) - y) / y)^2: the rows divided by y against a target of ones; where
        # the steps do not tell two terms apart, lstsq's least-norm answer splits them
        coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
        a, b, c, e = (float(v) for v in coef)
        return a, b, c, e

    def predict(self, decode_rows: int, prefill_tokens: int) -> float | None:
        """Predicted seconds of such a step, or None while unfitted."""
        coef = self.coefficients()
        if coef is None:
            return None
        a, b, c, e = coef
        return a + b * decode_rows + c * prefill_tokens + (e if prefill_tokens else 0.0)

    def prefill_tokens_within(self, decode_rows: int, factor: float) -> int | None:
        """The most prompt tokens a step of `decode_rows` decodes may add and still be predicted to take at
        most `factor` times a step of those decodes alone (0 when even one token is over). None while the
        model cannot say: unfitted, or a fit in which decodes take no time or prompt tokens cost nothing."""
        coef = self.coefficients()
        if coef is None:
            return None
        a, b, c, e = coef
        decode = a + b * decode_rows
        if decode <= 0 or c <= 0:
            return None
        return max(0, int(((factor - 1.0) * decode - e) / c))
