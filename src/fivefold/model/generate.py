"""Autoregressive decoding with a per-layer KV cache: greedy, or temperature / top-k sampling.

The prompt is run once (prefill) to fill the caches; every further step feeds only the newest
token. Prompts of different lengths are left-padded: a key mask hides the padding and each
row's positions count its own tokens only, so a row decodes as it would alone.

The loop (`decode`) is written against a `step` callable, `step(inputs, positions, key_mask) ->
next token per row`, so the same padding, stopping, streaming and timing serve one process
(`ModelStep`) and a sharded model spread over ranks (`fivefold.parallel.serve`). Replicas whose
steps meet in collectives (expert parallelism: each MoE layer's all-to-alls) decode in lockstep
through a `Lockstep`: a replica whose rows are all done keeps taking part, with nothing to decode,
until every peer is done.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from fivefold.model.attention import KVCache
from fivefold.model.transformer import Transformer

Step = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class Lockstep(Protocol):
    """Peers whose decoding steps must meet, one for one."""

    def busy(self, mine: bool) -> bool:
        """Whether this replica (`mine`) or any peer still has rows to decode: the same answer on
        every peer, so that all take the same number of steps."""
        ...

    def idle(self) -> None:
        """This replica's part in one step of its peers, with no rows of its own."""
        ...


@dataclass
class Sampler:
    """How a row's next token is chosen; sampling draws from one generator per prompt, seeded by
    (seed, prompt index), so a prompt's text does not depend on what it is batched with."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    seed: int = 0

    def generators(self, prompt_ids: Sequence[int]) -> list[torch.Generator]:
        # folded into 63 bits: any --seed up to 2^63-1 seeds a generator (the product overflows
        # torch's 64-bit seed above about 1.8e13), and every smaller seed keeps its stream
        return [torch.Generator().manual_seed((self.seed * 1_000_003 + i) % 2**63) for i in prompt_ids]

    def pick(
        self, logits: torch.Tensor, generators: list[torch.Generator] | torch.Generator | None
    ) -> torch.Tensor:
        """logits [b, V] -> one token id per row; one generator per row, or one for the batch."""
        if self.greedy or self.temperature <= 0 or not isinstance(generators, list):
            return _pick(logits.float(), self.greedy, self.temperature, self.top_k, generators)
        rows = [
            _pick(logits[i : i + 1].float(), False, self.temperature, self.top_k, g)
            for i, g in enumerate(generators)
        ]
        return torch.cat(rows)


@dataclass
class Generation:
    """Per prompt: the new tokens and the timings of its batch (seconds)."""

    tokens: list[list[int]]
    first_token_s: float  # prefill + the first token
    step_s: list[float] = field(default_factory=list)  # each later token's step, in order

    def timings(self, row: int) -> dict[str, float]:
        n = len(self.tokens[row])
        decode = self.step_s[: max(0, n - 1)]
        total = self.first_token_s + sum(decode)
        return {
            "time_to_first_token_s": self.first_token_s,
            "decode_s_per_token": sum(decode) / len(decode) if decode else 0.0,
            "tokens_per_s": n / total if total > 0 else 0.0,
        }


class ModelStep:
    """`step` for a whole model in this process."""

    def __init__(
        self,
        model: Transformer,
        sampler: Sampler,
        generators: list[torch.Generator] | torch.Generator | None,
    ) -> None:
        self.model = model
        self.sampler = sampler
        self.generators = generators
        self.caches = [KVCache() for _ in model.model.layers]
        self.device = next(model.parameters()).device

    def __call__(self, inputs: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor | None):
        for cache in self.caches:
            cache.key_mask = None if key_mask is None else key_mask.to(self.device)
        logits = self.model(inputs.to(self.device), positions.to(self.device), caches=self.caches)
        return self.sampler.pick(logits[:, -1, :], self.generators).cpu()


@torch.no_grad()
def decode(
    step: Step,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    eos_token_id: int | Sequence[int] | None = None,
    on_token: Callable[[int, int], None] | None = None,
    peers: Lockstep | None = None,
) -> Generation:
    """Run `step` until every row has its `max_new_tokens` (one for all, or one per prompt) or has
    produced an end id.

    Rows that are done keep being fed (the batch keeps its shape); their tokens are dropped.
    `on_token(row, token)` sees each kept token as soon as it is chosen. With `peers`, the loop
    runs until no peer decodes; once this replica is done it only idles (no step, no timing).
    """
    b = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts])
    width = int(lengths.max())
    ids = torch.zeros(b, width, dtype=torch.long)
    valid = torch.zeros(b, width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        valid[i, width - len(p) :] = True
    padded = bool((lengths != width).any())
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    ends = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    out: list[list[int]] = [[] for _ in range(b)]
    limits = [max_new_tokens] * b if isinstance(max_new_tokens, int) else list(max_new_tokens)
    done = [n <= 0 for n in limits]
    result = Generation(out, 0.0)
    inputs, mask = ids, (valid if padded else None)
    next_pos = lengths.clone()
    first = True
    while True:
        mine = not all(done)
        if not (peers.busy(mine) if peers is not None else mine):
            break
        if not mine:
            assert peers is not None
            peers.idle()
            continue
        start = time.perf_counter()
        token = step(inputs, positions, mask)
        picked = token.tolist()
        elapsed = time.perf_counter() - start
        if first:
            result.first_token_s, first = elapsed, False
        else:
            result.step_s.append(elapsed)
        for i, t in enumerate(picked):
            if done[i]:
                continue
            out[i].append(t)
            if on_token is not None:
                on_token(i, t)
            done[i] = t in ends or len(out[i]) >= limits[i]
        inputs = token.view(b, 1).long()
        positions = next_pos.view(b, 1).clone()
        next_pos += 1
        if mask is not None:
            mask = torch.cat((mask, torch.ones(b, 1, dtype=torch.bool)), dim=1)
    return result


@torch.no_grad()
def generate(
    model: Transformer,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    greedy: bool = True,
    temperature: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    eos_token_id: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """prompt_ids [b, s] -> the new tokens [b, n], n <= max_new_tokens (equal-length prompts).

    Decoding stops early once every sequence has produced an end-of-sequence id (`eos_token_id`,
    one or several); a sequence that is done repeats its end id, so the rows stay equal in length.
    Sampling draws every row from the one `generator`.
    """
    if prompt_ids.dim() == 1:
        prompt_ids = prompt_ids.unsqueeze(0)
    was_training = model.training
    model.eval()
    b = prompt_ids.shape[0]
    step = ModelStep(model, Sampler(greedy, temperature, top_k), generator)
    try:
        got = decode(step, prompt_ids.tolist(), max_new_tokens, eos_token_id)
    finally:
        model.train(was_training)
    n = max((len(t) for t in got.tokens), default=0)
    if n == 0:
        return prompt_ids.new_zeros((b, 0))
    rows = [t + [t[-1]] * (n - len(t)) for t in got.tokens]  # a finished row repeats its end id
    return torch.tensor(rows, dtype=torch.long)


def _pick(
    logits: torch.Tensor, greedy: bool, temperature: float, top_k: int, generator: torch.Generator | None
) -> torch.Tensor:
    """logits [b, V] -> one token id per row."""
    # a temperature the logits' dtype rounds to 0 is the greedy limit (dividing by it gives NaN)
    if greedy or temperature < torch.finfo(logits.dtype).tiny:
        return logits.argmax(dim=-1)
    # shifted to a maximum of 0 first (softmax does not change): a tiny temperature then makes the
    # rest -inf, not the largest +inf, whose softmax is NaN
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    # sample on the CPU so a seed gives the same text on any device
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(logits.device)
