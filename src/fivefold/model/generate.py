"""Autoregressive decoding with a per-layer KV cache: greedy, or temperature / top-k sampling.

The prompt is run once (prefill) to fill the caches; every further step feeds only the newest
token. Prompts in a batch have equal length (no padding, so no attention mask is needed).
"""

from __future__ import annotations

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
    eos_token_id: int | None = None,
) -> torch.Tensor:
    """prompt_ids [b, s] -> the new tokens [b, n], n <= max_new_tokens.

    Decoding stops early once every sequence has produced `eos_token_id`; a sequence that is done
    keeps emitting it, so the rows stay equal in length.
    """
    if prompt_ids.dim() == 1:
        prompt_ids = prompt_ids.unsqueeze(0)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    caches = [KVCache() for _ in model.model.layers]
    inputs = prompt_ids.to(device)
    done = torch.zeros(inputs.shape[0], dtype=torch.bool, device=device)
    new_tokens: list[torch.Tensor] = []
    try:
        for _ in range(max_new_tokens):
            logits = model(inputs, caches=caches)[:, -1, :].float()
            token = _pick(logits, greedy, temperature, top_k, generator)
            if eos_token_id is not None:
                token = torch.where(done, torch.full_like(token, eos_token_id), token)
                done |= token == eos_token_id
            new_tokens.append(token)
            if eos_token_id is not None and bool(done.all()):
                break
            inputs = token[:, None]
    finally:
        model.train(was_training)
    if not new_tokens:
        return prompt_ids.new_zeros((prompt_ids.shape[0], 0))
    return torch.stack(new_tokens, dim=1).cpu()


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
