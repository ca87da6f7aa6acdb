"""Autoregressive decoding with a per-layer KV cache: greedy, or temperature / top-k sampling.

The prompt is run once (prefill) to fill the caches; every further step feeds only the newest
token. Prompts in a batch have equal length (no padding, so no attention mask is needed).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fivefold.model.attention import KVCache
from fivefold.model.transformer import Transformer


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
    """prompt_ids [b, s] -> the new tokens [b, n], n <= max_new_tokens.

    Decoding stops early once every sequence has produced an end-of-sequence id (`eos_token_id`,
    one or several); a sequence that is done repeats its end id, so the rows stay equal in length.
    """
    if prompt_ids.dim() == 1:
        prompt_ids = prompt_ids.unsqueeze(0)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    caches = [KVCache() for _ in model.model.layers]
    inputs = prompt_ids.to(device)
    done = torch.zeros(inputs.shape[0], dtype=torch.bool, device=device)
    ends = _as_tensor(eos_token_id, device)
    last = torch.zeros_like(done, dtype=torch.long)
    new_tokens: list[torch.Tensor] = []
    try:
        for _ in range(max_new_tokens):
            logits = model(inputs, caches=caches)[:, -1, :].float()
            token = _pick(logits, greedy, temperature, top_k, generator)
            if ends is not None:
                token = torch.where(done, last, token)
                done |= torch.isin(token, ends)
                last = token
            new_tokens.append(token)
            if ends is not None and bool(done.all()):
                break
            inputs = token[:, None]
    finally:
        model.train(was_training)
    if not new_tokens:
        return prompt_ids.new_zeros((prompt_ids.shape[0], 0))
    return torch.stack(new_tokens, dim=1).cpu()


def _as_tensor(ids: int | Sequence[int] | None, device: torch.device) -> torch.Tensor | None:
    if ids is None:
        return None
    return torch.tensor([ids] if isinstance(ids, int) else list(ids), dtype=torch.long, device=device)


def _pick(
    logits: torch.Tensor, greedy: bool, temperature: float, top_k: int, generator: torch.Generator | None
) -> torch.Tensor:
    """logits [b, V] -> one token id per row."""
    if greedy or temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    # sample on the CPU so a seed gives the same text on any device
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(1).to(logits.device)
