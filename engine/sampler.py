"""Picks one token per sequence, vectorised over the batch, with per-request parameters.

Logits arrive in the model's dtype. When every row is greedy and nothing asks for logprobs or
processing, the argmax is taken on them as they are (the CPU backend's kernel reads bfloat16 in
place). With a backend's race (the CPU kernels' `sample_race`), greedy rows and sampled rows
without a top-k (their top-p and min-p a cut the kernel finds) are chosen by it in one pass over
their logits, with uniforms of a counter-based generator keyed by the row's seed (or the sampler's
own key), and only the other rows take the paths below (`_race`). Otherwise logits are converted to
float32 first. Greedy rows take the argmax. Sampled rows go through temperature, top-k, top-p and
min-p, then the exponential race `argmax(p / q)` with q ~ Exp(1). When every sampled row has a
top-k, only the batch's largest k candidates per row are taken (`topk`) and the rest works on them;
when every sampled row asks for top-p without a top-k, the nucleus is looked for among each row's
NUCLEUS_CANDIDATES largest first; the vocabulary is sorted only when neither holds (or a row's
nucleus is wider). The noise is drawn on the logits' device: a request with a seed
draws q from its own generator there (seeded at its first sample), in a shape of its own (k values
with a top-k, the vocabulary's without), so its tokens do not depend on what else is in the batch.
Logprobs are those of the model's raw distribution (log_softmax of the logits), or with
logprobs_mode "processed_logprobs" those of the distribution the token was drawn from (after
bias, penalties, grammar, temperature, top-k, top-p and min-p; greedy rows at temperature 1).
A request with structured output has the tokens its grammar forbids masked to -inf last, after
bias and penalties (engine/structured.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.request import Request
from engine.structured import allocate_bitmask, apply_bitmask

# top-p's candidates before the vocabulary is sorted: enough for the nucleus of a trained model's
# distribution at the usual top_p (0.9-0.95); a row whose nucleus is wider sorts everything
NUCLEUS_CANDIDATES = 256
# the race's counters of a seeded row: this plus the index of the token drawn (an unseeded row's
# counters count up from 0 with the sampler's own key: the two never meet)
RACE_SEEDED = -(2**63)
# (logits [rows, vocab], temperature float32 [rows] (0: greedy), top_p and min_p float32 [rows] (1 and 0:
# off), keys int64 [rows], counters int64 [rows]) -> int64 tokens [rows], or None where it cannot take
# them (a backend's `sample_race`)
Race = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], "torch.Tensor | None"]


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[float] | None  # of the sampled token, per row; None when no row asked
    top_logprobs: list[dict[int, float] | None] | None


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: on CUDA through pinned memory (torch caches pinned blocks), without
    blocking; a copy from pageable memory, or indexing a CUDA tensor with a Python list, waits."""
    if device.type == "cpu":
        return tensor
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _on(device: torch.device, values: list, dtype: torch.dtype) -> torch.Tensor:
    """A small host list as a tensor on `device` (`to_device`)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def _logsumexp(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits.float(), dim=-1)


def _needs_adjusting(req: Request) -> bool:
    sp = req.sampling
    ban_eos = req.num_generated < sp.min_new_tokens and req.eos_token_ids
    return bool(sp.logit_bias or ban_eos or sp.needs_penalties)


def _needs_processing(req: Request) -> bool:
    return req.matcher is not None or _needs_adjusting(req)


class Sampler:
    def __init__(self, seed: int | None = None, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 logprobs_mode: str = "raw_logprobs", race: Race | None = None,
                 logsumexp: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:  # fmt: skip
        self.argmax = argmax or _argmax  # [rows, vocab] -> int64 [rows]: the backend's, when it has one
        self.race = race  # the backend's one-pass race (`Race`), when it has one
        self.logsumexp = logsumexp or _logsumexp  # [rows, vocab] -> float32 [rows]: the backend's, when it has one
        self.processed_logprobs = logprobs_mode == "processed_logprobs"
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self._device_generators: dict[torch.device, torch.Generator | None] = {}
        # the race's stream for unseeded rows: one key, and a counter a row drawn (seeded rows: RACE_SEEDED)
        self._race_key = int(torch.randint(-(2**63), 2**63 - 1, (), generator=self.generator))
        self._race_draws = 0

    def _generator(self, device: torch.device) -> torch.Generator | None:
        """The unseeded rows' generator on `device`, seeded from the host one; None (torch's default)
        on a device that has no generators of its own."""
        if device.type == "cpu":
            return self.generator
        if device not in self._device_generators:
            try:
                gen = torch.Generator(device=device)
                gen.manual_seed(int(torch.randint(0, 2**62, (), generator=self.generator)))
            except RuntimeError:
                gen = None
            self._device_generators[device] = gen
        return self._device_generators[device]

    def __call__(self, logits: torch.Tensor, reqs: list[Request], default_logprobs: bool = False) -> SampleResult:
        return self.sample(logits, reqs, default_logprobs).result()

    def sample(self, logits: torch.Tensor, reqs: list[Request], default_logprobs: bool = False) -> PendingSample:
        """The rows' tokens, still on the logits' device until `result()` (the step's one wait on CUDA)."""
        want_logprobs = default_logprobs or any(r.sampling.logprobs is not None for r in reqs)
        if not want_logprobs and all(r.sampling.greedy and not _needs_processing(r) for r in reqs):
            return PendingSample(self.argmax(logits))
        if self.race is not None and not (want_logprobs and self.processed_logprobs):
            raced = self._race(logits, reqs, want_logprobs)
            if raced is not None:
                return raced
        logits = logits.float()
        raw_logprobs = _Logprobs(logits, self.logsumexp(logits)) if want_logprobs and not self.processed_logprobs else None
        logits = self._process(logits, reqs)
        greedy = [r.sampling.greedy for r in reqs]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
            if want_logprobs and self.processed_logprobs:
                raw_logprobs = _Logprobs(logits, self.logsumexp(logits))
        else:
            tokens, probs, ids = self._sample(logits, reqs, greedy)
            if want_logprobs and self.processed_logprobs:
                if ids is not None:  # over the vocabulary: what was not a candidate has probability 0
                    probs = torch.zeros_like(logits).scatter_(1, ids, probs)
                drawn_from = torch.where(_on(logits.device, greedy, torch.bool)[:, None], torch.softmax(logits, dim=-1), probs)
                raw_logprobs = _Logprobs(torch.log(drawn_from / drawn_from.sum(dim=-1, keepdim=True)))
        return PendingSample(tokens, raw_logprobs, reqs)

    def _race(self, logits: torch.Tensor, reqs: list[Request], want_logprobs: bool) -> PendingSample | None:
        """The step's tokens by the backend's one-pass race: greedy rows and sampled rows without a
        top-k (with their top-p and min-p) in it; the rest through `_sample` on their own rows. None
        when the backend cannot take these logits, or every row has a top-k. A seeded row's uniforms
        are those of (its seed, the index of the token it draws), an unseeded row's the sampler's stream:
        neither depends on the batch, and the race is the only path such a row takes."""
        plain = [r.sampling.greedy or not 0 < r.sampling.top_k < logits.shape[1] for r in reqs]
        if not any(plain):
            return None
        raw_logprobs = _Logprobs(logits, self.logsumexp(logits)) if want_logprobs else None
        if any(_needs_processing(r) for r in reqs):
            logits = self._process(logits.float(), reqs)
        keys, counters = [], []
        for row, req in enumerate(reqs):
            seed = req.sampling.seed
            keys.append(self._race_key if seed is None else seed)
            counters.append(self._race_draws + row if seed is None else RACE_SEEDED + req.num_generated)
        raced = [p and not r.sampling.greedy for r, p in zip(reqs, plain)]
        temperature = [r.sampling.temperature if s else 0.0 for r, s in zip(reqs, raced)]
        top_p = [r.sampling.top_p if s else 1.0 for r, s in zip(reqs, raced)]
        min_p = [r.sampling.min_p if s else 0.0 for r, s in zip(reqs, raced)]
        floats = [torch.tensor(v, dtype=torch.float32) for v in (temperature, top_p, min_p)]
        tokens = self.race(logits, *floats, torch.tensor(keys), torch.tensor(counters))
        if tokens is None:
            return None
        self._race_draws += len(reqs)
        rest = [row for row, p in enumerate(plain) if not p]
        if rest:  # a top-k: their candidates, on their rows alone
            index = torch.tensor(rest)
            drawn, _, _ = self._sample(logits.float().index_select(0, index), [reqs[i] for i in rest], [False] * len(rest))
            tokens.index_copy_(0, index, drawn)
        return PendingSample(tokens, raw_logprobs, reqs)

    @staticmethod
    def _process(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Logit bias, the EOS ban before min_new_tokens, the penalties, then the grammar's mask,
        for the rows that ask."""
        cloned = False
        constrained = [row for row, req in enumerate(reqs) if req.matcher is not None]
        banned_ends: dict[int, torch.Tensor] = {}  # constrained rows whose EOS is banned: their EOS logits
        for row, req in enumerate(reqs):
            if not _needs_adjusting(req):
                continue
            sp = req.sampling
            ban_eos = req.num_generated < sp.min_new_tokens and req.eos_token_ids
            if not cloned:
                logits, cloned = logits.clone(), True
            x = logits[row]
            if sp.logit_bias:
                ids, biases = sp.bias
                x.index_add_(0, to_device(ids, x.device), to_device(biases.to(x.dtype), x.device))
            if sp.repetition_penalty != 1.0:
                seen = _on(x.device, sorted(set(req.token_ids)), torch.long)
                vals = x[seen]
                x[seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
            if sp.presence_penalty or sp.frequency_penalty:
                counts = Counter(req.generated_ids)  # each generated token once, with how often it came
                n = _on(x.device, list(counts.values()), x.dtype)
                x.index_add_(0, _on(x.device, list(counts), torch.long), -(sp.frequency_penalty * n + sp.presence_penalty))
            if ban_eos:
                ends = _on(x.device, list(req.eos_token_ids), torch.long)
                if req.matcher is not None:
                    banned_ends[row] = x.index_select(0, ends)
                x.index_fill_(0, ends, float("-inf"))
        if constrained:
            if not cloned:
                logits = logits.clone()
            bitmask = allocate_bitmask(len(constrained), logits.shape[1])
            for i, row in enumerate(constrained):
                reqs[row].matcher.fill_bitmask(bitmask, i)
            apply_bitmask(logits, bitmask, constrained)
            for row, saved in banned_ends.items():  # a grammar that may only end, with the end banned: it ends
                if torch.isinf(logits[row]).all():
                    ends = _on(logits.device, list(reqs[row].eos_token_ids), torch.long)
                    logits[row].index_copy_(0, ends, saved.clamp(min=torch.finfo(logits.dtype).min))
        return logits

    def _sample(self, logits: torch.Tensor, reqs: list[Request], greedy: list[bool]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """Tokens, and what the sampled rows drew from: probabilities (unnormalised after min-p) over
        candidates, and the candidates' token ids (None: the candidates are the whole vocabulary, in
        order).

        Candidates: when every sampled row has a top-k, the batch's largest k by `topk` (no sort of
        the vocabulary); when some row has none but a top-k or top-p is asked, the whole vocabulary
        sorted; else the vocabulary as it is. Ranked candidates are ordered by logit, ties by token id,
        so a row's candidates do not depend on the batch. Top-k keeps a row's first k, top-p the
        smallest prefix holding p of the mass, min-p what reaches min_p of the largest probability."""
        num_rows, vocab = logits.shape
        device = logits.device
        sampled = [not g for g in greedy]
        temperature = _on(device, [r.sampling.temperature if s else 1.0 for r, s in zip(reqs, sampled)], torch.float32)
        top_k = [r.sampling.top_k if s and 0 < r.sampling.top_k < vocab else 0 for r, s in zip(reqs, sampled)]
        top_p = [r.sampling.top_p if s else 1.0 for r, s in zip(reqs, sampled)]
        min_p = [r.sampling.min_p if s else 0.0 for r, s in zip(reqs, sampled)]
        ids: torch.Tensor | None = None
        # without a top-k, top-p's mass is the whole row's, from its own softmax whatever the candidates (all of
        # it sorted, or its top): the same bits either way, so the same nucleus
        row_probs: torch.Tensor | None = None
        if all(k for k, s in zip(top_k, sampled) if s):  # every sampled row has a top-k
            values, ids = _ranked_top(logits, max(top_k))  # a temperature keeps the order: scale k values only
            values = values / temperature[:, None]
        elif any(top_k) or any(p < 1.0 for p in top_p):
            scaled = logits / temperature[:, None]
            top = None
            if not any(top_k):
                row_probs = torch.softmax(scaled, dim=-1)
                top = _nucleus_candidates(scaled, row_probs, _on(device, top_p, torch.float32), sampled)
            values, ids = top if top is not None else scaled.sort(dim=-1, descending=True, stable=True)
        else:
            values = logits / temperature[:, None]
        width = values.shape[1]
        if any(top_k):
            k = _on(device, [k or width for k in top_k], torch.long)
            values.masked_fill_(torch.arange(width, device=device)[None, :] >= k[:, None], float("-inf"))
        if any(p < 1.0 for p in top_p):
            probs = torch.softmax(values, dim=-1) if row_probs is None else row_probs.gather(1, ids)
            before = torch.cumsum(probs, dim=-1).sub_(probs)  # the mass ranked above each candidate
            remove = before >= _on(device, top_p, torch.float32)[:, None]
            remove[:, 0] = False
            values.masked_fill_(remove, float("-inf"))
            del probs, before, remove
        probs = torch.softmax(values, dim=-1)
        if any(m > 0 for m in min_p):
            threshold = _on(device, min_p, torch.float32)[:, None] * probs.max(dim=-1, keepdim=True).values
            probs.masked_fill_(probs < threshold, 0.0)
        noise = self._noise(reqs, sampled, top_k, ids, width, vocab, device)
        choice = torch.div(probs, noise, out=noise).argmax(dim=-1)
        tokens = choice if ids is None else ids.gather(1, choice[:, None]).squeeze(1)
        if not any(greedy):
            return tokens, probs, ids
        return torch.where(_on(device, greedy, torch.bool), logits.argmax(dim=-1), tokens), probs, ids

    def _noise(self, reqs: list[Request], sampled: list[bool], top_k: list[int], ids: torch.Tensor | None,
               width: int, vocab: int, device: torch.device) -> torch.Tensor:  # fmt: skip
        """Exp(1) noise over the candidates, drawn on the device. Unseeded rows draw together from
        the sampler's stream. A seeded row draws from its own stream a shape of its own: its top-k
        candidates' k values, by rank; without a top-k, the vocabulary's, by token id (also when the
        candidates are only the vocabulary's top, `_nucleus_candidates`)."""
        unseeded = [row for row, (r, s) in enumerate(zip(reqs, sampled)) if s and r.sampling.seed is None]
        if len(unseeded) == len(reqs):  # every row draws from the sampler's stream: the draw is the noise
            return _exp_noise(torch.rand(len(reqs), width, device=device, generator=self._generator(device)))
        noise = torch.ones(len(reqs), width, device=device)
        if unseeded:
            drawn = _exp_noise(torch.rand(len(unseeded), width, device=device, generator=self._generator(device)))
            noise.index_copy_(0, _on(device, unseeded, torch.long), drawn)
        for row, req in enumerate(reqs):
            if not sampled[row] or req.sampling.seed is None:
                continue
            if req.generator is None:
                req.generator = _new_generator(device, req.sampling.seed)
            if top_k[row]:
                noise[row, : top_k[row]] = _exponential(top_k[row], req.generator, device)
            elif ids is None:  # no top-k: the candidates are the whole vocabulary (width), by token id
                noise[row] = _exponential(width, req.generator, device)
            else:  # the vocabulary ranked (or its top): each candidate token id's noise, in rank order
                noise[row] = _exponential(vocab, req.generator, device)[ids[row]]
        return noise


class _Logprobs:
    """The log-probabilities of [rows, vocab] distributions as `values` minus each row's `norm` [rows]:
    for logits, the logits as they are (in the model's dtype) and their logsumexp, so that only the
    entries asked for are normalised, in float32 (a log_softmax of a step's logits took 1.6 ms at 16
    rows of a 49,152-token vocabulary, the CPU kernel's logsumexp reads them in place); for
    log-probabilities, themselves and 0."""

    def __init__(self, values: torch.Tensor, norm: torch.Tensor | None = None) -> None:
        self.values = values
        self.norm = (torch.zeros(values.shape[0], device=values.device) if norm is None else norm)[:, None]

    def at(self, ids: torch.Tensor) -> torch.Tensor:
        """The log-probabilities of ids [rows, k], float32."""
        return self.values.gather(1, ids).float() - self.norm

    def top(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's n largest log-probabilities (float32) and their ids, largest first."""
        values, ids = self.values.topk(n, dim=-1)
        return values.float() - self.norm, ids


class PendingSample:
    """A step's sampled tokens (with their logprobs when asked) still on the logits' device: `tokens` feeds
    the next step's inputs there (async batching, engine/llm_engine.py), and `result()` brings them to the
    host. On CUDA the copies to the host are started at once, without blocking, and `result()` waits for
    them alone (an event), not for what the stream took on after them: the next step's forward."""

    def __init__(self, tokens: torch.Tensor, raw_logprobs: _Logprobs | None = None,
                 reqs: list[Request] | None = None) -> None:  # fmt: skip
        self.tokens = tokens
        parts = [tokens]
        self._ns: list[int] = []
        if raw_logprobs is not None:
            parts.append(raw_logprobs.at(tokens[:, None]).squeeze(1))
            self._ns = [req.sampling.logprobs or 0 for req in reqs or ()]
            if max(self._ns, default=0):
                parts.extend(raw_logprobs.top(max(self._ns)))  # one topk for the batch, each row's first n
        self._event = None
        if tokens.device.type == "cuda":  # into pinned host memory, in stream order
            parts = [part.to("cpu", non_blocking=True) for part in parts]
            self._event = torch.cuda.Event()
            self._event.record()
        self._parts = parts
        self._result: SampleResult | None = None

    def result(self) -> SampleResult:
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            self._result = _host_result(self._parts, self._ns)
        return self._result


def _host_result(parts: list[torch.Tensor], ns: list[int]) -> SampleResult:
    """The tokens, with the logprobs of each and each row's top ones when asked."""
    token_list = parts[0].tolist()
    if len(parts) == 1:
        return SampleResult(token_list, None, None)
    sampled = parts[1].tolist()
    if len(parts) == 2:
        return SampleResult(token_list, sampled, [None] * len(ns))
    values, ids = parts[2].tolist(), parts[3].tolist()
    tops = [dict(zip(ids[row][:n], values[row][:n])) if n else None for row, n in enumerate(ns)]
    return SampleResult(token_list, sampled, tops)


def _nucleus_candidates(scaled: torch.Tensor, row_probs: torch.Tensor, top_p: torch.Tensor, sampled: list[bool]
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """Top-p without sorting the vocabulary: each row's NUCLEUS_CANDIDATES largest scaled logits and their
    ids, ranked as the full sort ranks them (by value, ties by id); None (sort it all) unless every
    sampled row's nucleus ends within them, before the tokens that tie with the first one left out:
    the full sort's top-p cut (the mass ranked above a candidate, computed as the cut computes it,
    reaching the row's top_p) removes the first of them. The nucleus, and so the token, are then the
    full sort's; seeded rows draw their noise by token id either way."""
    k = min(NUCLEUS_CANDIDATES, scaled.shape[1] - 1)
    if k < 1:
        return None
    values, ids = _ranked_top(scaled, k + 1)
    probs = row_probs.gather(1, ids)  # `row_probs`: softmax(scaled), as top-p takes them
    before = torch.cumsum(probs, dim=-1).sub_(probs)  # the mass ranked above each candidate, as the cut has it
    # the first candidate as large as the last one: from there on `topk` may have picked other tokens of
    # the same value than the sort would (bfloat16 logits tie often); the cut must remove all of them
    edge = (values == values[:, k : k + 1]).int().argmax(dim=-1, keepdim=True)
    rows = _on(scaled.device, sampled, torch.bool)
    if not bool(((before.gather(1, edge).squeeze(1) >= top_p) | ~rows).all()):
        return None
    return values[:, :k], ids[:, :k]


def _ranked_top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row and their ids, by value, ties by id (as a stable sort of the row
    would give: which tied value `topk` lists first is not defined)."""
    values, ids = x.topk(k, dim=-1)
    ids, order = ids.sort(dim=-1)
    values, order = values.gather(1, order).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(1, order)


def _new_generator(device: torch.device, seed: int) -> torch.Generator:
    """A generator on `device` seeded with `seed`; on the host for a device without generators (meta)."""
    try:
        return torch.Generator(device=device).manual_seed(seed)
    except RuntimeError:
        return torch.Generator().manual_seed(seed)


def _exponential(n: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """n Exp(1) draws of `generator`, on `device` (drawn where the generator lives)."""
    if generator.device == device:
        return _exp_noise(torch.rand(n, device=device, generator=generator))
    return to_device(_exp_noise(torch.rand(n, generator=generator)), device)


def _exp_noise(uniform: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws made in place from uniform ones in [0, 1): -log(u). torch's `exponential_` draws the
    same distribution about 5.6x slower on the CPU (0.71 against 0.13 ms a row of SmolLM2's 49,152-token
    vocabulary; 11 ms a step at 16 sampled rows). A u of 0 (one draw in 2^24) gives +inf, a candidate
    that cannot win the race, as in effect any draw past the largest finite one, 16.6, cannot."""
    return uniform.log_().neg_()
