"""The model against independent references: HF's rope tables, naive attention and routing written
out token by token here, explicit losses, and the per-parameter seeding contract."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from fivefold.config import ModelSpec, load_model
from fivefold.model import build_model, lm_loss, materialize
from fivefold.model.attention import rope_inverse_frequencies
from fivefold.model.moe import MoE, moe_layers, set_aux_loss_scale


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)  # the random inputs below; weights come from their own per-name seeds


def _spec(preset: str = "tiny", **changes) -> ModelSpec:
    return dataclasses.replace(load_model(preset), **changes).validate()


def _model(spec: ModelSpec, seed: int = 0, scale: float = 1.0):
    model = materialize(build_model(spec), "cpu", seed)
    if scale != 1.0:  # larger weights: routing and attention far from uniform
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.mul_(scale)
    return model


def _tokens(batch: int = 2, seq: int = 12, vocab: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------
# rope, attention


def test_llama3_rope_scaling_matches_hf() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    spec = _spec("llama3-8b", rope_scaling="llama3", rope_factor=8.0, rope_original_max_len=8192)
    config = transformers.LlamaConfig(
        hidden_size=spec.hidden,
        num_attention_heads=spec.heads,
        head_dim=spec.head_dim,
        rope_theta=spec.rope_theta,
        rope_scaling={
            "rope_type": "llama3",
            "factor": spec.rope_factor,
            "low_freq_factor": spec.rope_low_freq_factor,
            "high_freq_factor": spec.rope_high_freq_factor,
            "original_max_position_embeddings": spec.rope_original_max_len,
        },
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = rope_inverse_frequencies(spec)
    torch.testing.assert_close(ours, expected, atol=0, rtol=0)
    plain = rope_inverse_frequencies(dataclasses.replace(spec, rope_scaling="none"))
    assert (ours < plain).any() and (ours == plain).any()  # long wavelengths slowed, short kept


def _naive_attention(attn, x: torch.Tensor, positions: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """Loops over query heads; each reads kv head h // (heads / kv_heads); explicit causal softmax."""
    b, s, _ = x.shape
    d = spec.head_dim
    q = (x @ attn.q_proj.weight.T).view(b, s, spec.heads, d)
    k = (x @ attn.k_proj.weight.T).view(b, s, spec.kv_heads, d)
    v = (x @ attn.v_proj.weight.T).view(b, s, spec.kv_heads, d)
    if spec.qk_norm:

        def rms(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + spec.norm_eps) * w

        q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
    angle = positions[:, :, None].float() * rope_inverse_frequencies(spec)  # [b, s, d/2]
    cos, sin = angle.cos()[:, :, None], angle.sin()[:, :, None]

    def rotate(t: torch.Tensor) -> torch.Tensor:  # adjacent pairs (2i, 2i + 1) turn by angle i
        even, odd = t[..., 0::2], t[..., 1::2]
        return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)

    q, k = rotate(q), rotate(k)
    group = spec.heads // spec.kv_heads
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    heads = []
    for h in range(spec.heads):
        scores = q[:, :, h] @ k[:, :, h // group].transpose(1, 2) / math.sqrt(d)
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        heads.append(weights @ v[:, :, h // group])
    return torch.cat(heads, dim=-1) @ attn.o_proj.weight.T


@pytest.mark.parametrize("kv_heads,qk_norm", [(4, False), (2, False), (1, False), (2, True)])
@torch.no_grad()
def test_attention_against_naive_reference(kv_heads: int, qk_norm: bool) -> None:
    spec = _spec(kv_heads=kv_heads, qk_norm=qk_norm)
    model = _model(spec, scale=3.0)
    if qk_norm:  # non-trivial norm weights, so forgetting them would show
        for layer in model.model.layers.values():
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    attn = model.model.layers["0"].self_attn
    x = torch.randn(2, 10, spec.hidden)
    positions = torch.arange(10).expand(2, 10)
    rope = model.model.rotary_emb(positions, x.dtype)
    torch.testing.assert_close(
        attn(x, rope), _naive_attention(attn, x, positions, spec), atol=1e-5, rtol=1e-5
    )
    assert attn.k_proj.weight.shape[0] == kv_heads * spec.head_dim


# --------------------------------------------------------------------------------------------
# embeddings, construction, seeding


def test_tied_embeddings_share_one_tensor() -> None:
    spec = _spec(tie_embeddings=True)
    model = _model(spec)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == spec.num_params()
    untied = _model(_spec())
    assert sum(p.numel() for p in untied.parameters()) == _spec().num_params()
    # the head is the embedding: logits are hidden states times the embedding table
    ids = _tokens()
    hidden = {}
    model.model.norm.register_forward_hook(lambda m, i, o: hidden.setdefault("h", o))
    logits = model(ids)
    torch.testing.assert_close(logits, hidden["h"] @ model.model.embed_tokens.weight.T)
    lm_loss(logits, ids).backward()
    assert model.model.embed_tokens.weight.grad is not None


def test_meta_build_then_materialize_is_deterministic() -> None:
    spec = _spec("tiny-moe")
    meta = build_model(spec)
    assert all(p.is_meta for p in meta.parameters())
    a, b, c = _model(spec, seed=1), _model(spec, seed=1), _model(spec, seed=2)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
        if pa.dim() > 1:
            assert not torch.equal(pa, pc), name
    ids = _tokens()
    torch.testing.assert_close(a(ids), b(ids), atol=0, rtol=0)
    # init scale: std for inputs, std / sqrt(2 layers) for output projections, ones for norms
    layer = a.model.layers["0"]
    assert abs(layer.self_attn.q_proj.weight.std().item() - spec.init_std) < 0.004
    assert (
        abs(layer.self_attn.o_proj.weight.std().item() - spec.init_std / math.sqrt(2 * spec.layers)) < 0.002
    )
    assert torch.equal(layer.input_layernorm.weight, torch.ones(spec.hidden))


def test_per_parameter_seeding_does_not_depend_on_which_layers_exist() -> None:
    spec = _spec("tiny-moe", layers=6, moe_layers=3)
    full = _model(spec, seed=5)
    stage = build_model(spec)  # a pipeline stage: layers 2..3 only, no embedding or head
    for name in ("0", "1", "4", "5"):
        del stage.model.layers[name]
    stage.model.embed_tokens, stage.model.norm, stage.lm_head = None, None, None
    materialize(stage, "cpu", seed=5)
    expected = full.state_dict()
    got = stage.state_dict()
    assert set(got) == {k for k in expected if ".layers.2." in k or ".layers.3." in k}
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name
    # and the stage computes what those layers compute inside the full model
    x = torch.randn(2, 8, spec.hidden)
    positions = torch.arange(8).expand(2, 8)
    rope = full.model.rotary_emb(positions, x.dtype)
    with torch.no_grad():
        want = full.model.layers["3"](full.model.layers["2"](x, rope), rope)
        torch.testing.assert_close(stage(x), want, atol=0, rtol=0)


# --------------------------------------------------------------------------------------------
# mixture of experts


def _naive_moe(moe: MoE, x: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """Token by token: score every expert, take the k best, run them, mix by (renormalised) weight."""
    out = torch.zeros_like(x)
    ex = moe.experts
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            token = x[b, t]
            logits = moe.gate.weight @ token
            probs = logits.sigmoid() if spec.router_score == "sigmoid" else logits.softmax(-1)
            chosen = (probs + moe.gate.expert_bias).topk(spec.experts_per_token).indices
            weights = probs[chosen]
            if spec.router_norm_topk:
                weights = weights / weights.sum()
            for e, w in zip(chosen.tolist(), weights):
                hidden = F.silu(ex.gate_proj[e] @ token) * (ex.up_proj[e] @ token)
                out[b, t] += w * (ex.down_proj[e] @ hidden)
            if moe.shared_expert is not None:
                out[b, t] += moe.shared_expert(token)
    return out


@pytest.mark.parametrize(
    "changes",
    [
        {"router_score": "softmax", "shared_experts": 0},
        {"router_score": "softmax", "shared_experts": 1, "router_norm_topk": False},
        {"router_score": "sigmoid", "shared_experts": 1},
        {"router_score": "softmax", "experts_per_token": 1},
    ],
    ids=["softmax", "softmax-shared-unnormalised", "sigmoid-shared", "top1"],
)
@torch.no_grad()
def test_moe_matches_token_by_token_routing(changes) -> None:
    spec = _spec("tiny-moe", **changes)
    model = _model(spec, scale=4.0)
    moe = model.model.layers["0"].mlp
    moe.gate.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))  # selection only
    x = torch.randn(2, 9, spec.hidden)
    torch.testing.assert_close(moe(x), _naive_moe(moe, x, spec), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_moe_is_dropless_under_total_imbalance() -> None:
    spec = _spec("tiny-moe", shared_experts=0)
    model = _model(spec, scale=4.0)
    moe = model.model.layers["0"].mlp
    moe.gate.expert_bias.copy_(torch.tensor([100.0, 100.0, 0.0, 0.0]))  # every token picks experts 0 and 1
    moe.tokens_per_expert.zero_()
    x = torch.randn(3, 16, spec.hidden)
    torch.testing.assert_close(moe(x), _naive_moe(moe, x, spec), atol=1e-5, rtol=1e-5)
    assert moe.tokens_per_expert.tolist() == [48.0, 48.0, 0.0, 0.0]  # every token's 2 experts ran


def _explicit_aux(x: torch.Tensor, moe: MoE, spec: ModelSpec) -> torch.Tensor:
    """DeepSeek-V3 sequence-wise balance loss, written from its definition."""
    b, s, _ = x.shape
    k, E = spec.experts_per_token, spec.experts
    probs = (x @ moe.gate.weight.T).softmax(-1)  # [b, s, E]
    chosen = (probs + moe.gate.expert_bias).topk(k, dim=-1).indices
    total = x.new_zeros(())
    for seq in range(b):
        counts = torch.stack([(chosen[seq] == e).sum() for e in range(E)]).float()
        f = counts * E / (k * s)
        total = total + (f * probs[seq].mean(0)).sum()
    return total / b


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_aux_loss_gradient_equals_explicit_loss(scale: float) -> None:
    spec = _spec("tiny-moe", aux_loss_coef=0.3, moe_layers=2)
    ids, labels = _tokens(seed=1), _tokens(seed=2)

    model = _model(spec, scale=3.0).train()
    set_aux_loss_scale(model, scale)
    (lm_loss(model(ids), labels) * scale).backward()
    attached = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert all(m.last_aux_loss is not None for m in moe_layers(model))

    reference = _model(dataclasses.replace(spec, aux_loss_coef=0.0), scale=3.0).train()
    inputs: list[torch.Tensor] = []
    for m in moe_layers(reference):
        m.register_forward_pre_hook(lambda mod, args: inputs.append(args[0]))
    loss = lm_loss(reference(ids), labels)
    aux = sum(_explicit_aux(x, m, spec) for x, m in zip(inputs, moe_layers(reference)))
    ((loss + spec.aux_loss_coef * aux) * scale).backward()
    router_seen = False
    for name, p in reference.named_parameters():
        torch.testing.assert_close(attached[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)
        router_seen |= name.endswith("mlp.gate.weight")
    assert router_seen
    # and the aux term does change the router's gradient (the test can fail)
    reference.zero_grad()
    (lm_loss(reference(ids), labels) * scale).backward()
    gate = "model.layers.3.mlp.gate.weight"
    assert not torch.allclose(attached[gate], dict(reference.named_parameters())[gate].grad)


def test_aux_loss_free_bias_moves_towards_balance() -> None:
    spec = _spec("tiny-moe", aux_loss_coef=0.0, router_bias_rate=0.01, shared_experts=0)
    model = _model(spec, scale=2.0)
    moe = model.model.layers["0"].mlp
    with torch.no_grad():
        moe.gate.weight[0] += 0.03  # with inputs of positive mean, expert 0 wins nearly every token
    x = torch.randn(4, 32, spec.hidden) + 1.0

    def imbalance() -> float:
        moe.tokens_per_expert.zero_()
        with torch.no_grad():
            moe(x)
        counts = moe.tokens_per_expert.clone()
        return (counts.max() / counts.mean()).item()

    start = imbalance()
    loads = moe.tokens_per_expert.clone()
    bias_before = moe.gate.expert_bias.clone()
    moe.update_bias()
    step = moe.gate.expert_bias - bias_before
    overloaded, underloaded = loads > loads.mean(), loads < loads.mean()
    assert (step[overloaded] < 0).all() and (step[underloaded] > 0).all()
    assert moe.tokens_per_expert.sum() == 0  # counts restart after each update
    for _ in range(30):
        imbalance()
        moe.update_bias()
    assert start > 1.8 and imbalance() < 1.2, (start, imbalance())
    # selection-only: the bias does not enter the mixing weights
    probs = (x.reshape(-1, spec.hidden) @ moe.gate.weight.T).softmax(-1)
    weights, chosen, _ = moe.gate(x.reshape(-1, spec.hidden))
    picked = probs.gather(-1, chosen)
    torch.testing.assert_close(weights, picked / picked.sum(-1, keepdim=True))


def test_every_expert_gets_a_gradient_even_when_unused() -> None:
    spec = _spec("tiny-moe", shared_experts=0)
    model = _model(spec).train()
    moe = model.model.layers["0"].mlp
    with torch.no_grad():
        moe.gate.expert_bias.copy_(torch.tensor([100.0, 100.0, 0.0, 0.0]))
    lm_loss(model(_tokens()), _tokens(seed=3)).backward()
    grad = moe.experts.gate_proj.grad
    assert grad is not None and torch.count_nonzero(grad[2:]) == 0 and torch.count_nonzero(grad[:2]) > 0


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no grouped matmul")
def test_grouped_matmul_experts_equal_the_per_expert_loop() -> None:
    """The grouped-matmul path (taken on CUDA in bf16) computes what the loop does, gradients
    included, with an expert that gets no rows; torch's CPU grouped matmul runs it here in fp32."""
    from fivefold.model.moe import swiglu_grouped_mm, swiglu_per_expert

    gen = torch.Generator().manual_seed(0)
    experts, hidden, ffn = 4, 16, 24
    counts = torch.tensor([5, 0, 9, 3])
    x = torch.randn(int(counts.sum()), hidden, generator=gen)
    weights = [
        torch.randn(experts, ffn, hidden, generator=gen),
        torch.randn(experts, ffn, hidden, generator=gen),
        torch.randn(experts, hidden, ffn, generator=gen),
    ]
    grad_out = torch.randn(x.shape[0], hidden, generator=gen)
    results = []
    for fn in (swiglu_grouped_mm, swiglu_per_expert):
        inputs = [t.clone().requires_grad_() for t in (x, *weights)]
        out = fn(inputs[0], counts, *inputs[1:])
        out.backward(grad_out)
        results.append([out.detach(), *(t.grad for t in inputs)])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(results[0][2][1]) == 0  # gate_proj of the expert without rows: zeros


# --------------------------------------------------------------------------------------------
# 16-bit attention on CPU runs torch's kernel in fp32 (fivefold.model.cpu_attention)


def _saved_bytes(fn, *inputs: torch.Tensor) -> int:
    """Bytes autograd keeps for fn's backward, once per storage (what `fivefold verify` meters)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(seen.values())


@pytest.mark.parametrize("through_autocast", [False, True])
def test_cpu_attention_in_fp32_matches_reference_and_saves_what_bf16_sdpa_saves(
    through_autocast: bool,
) -> None:
    from fivefold.model.attention import AttentionCore
    from fivefold.model.cpu_attention import serves

    b, h, s, d = 2, 4, 64, 16
    leaves = [torch.randn(b, h, s, d, requires_grad=True) for _ in range(3)]
    grad = torch.randn(b, h, s, d)

    def run(fn):
        for t in leaves:
            t.grad = None
        if through_autocast:  # fp32 q/k/v handed in, autocast asks for bf16 (np1 and tp under bf16)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = fn(*leaves)
        else:  # bf16 q/k/v (FSDP's bf16 weights)
            out = fn(*[t.to(torch.bfloat16) for t in leaves])
        out.float().backward(grad)
        return out.float().detach(), [t.grad.clone() for t in leaves]

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    exact = [t.detach().to(torch.bfloat16).double().requires_grad_() for t in leaves]
    ref = F.scaled_dot_product_attention(*exact, is_causal=True)
    ref.backward(grad.double())
    core = AttentionCore()
    ours, ours_grads = run(core)
    kernel, kernel_grads = run(sdpa)
    assert ours.dtype == kernel.dtype and not torch.equal(ours, kernel)  # not torch's bf16 kernel
    # closer to the float64 answer than torch's bf16 kernel, and within bf16 rounding of it
    err_ours = (ours.double() - ref).abs().max()
    assert err_ours <= (kernel.double() - ref).abs().max() + 1e-3
    torch.testing.assert_close(ours.double(), ref.detach(), atol=2e-2, rtol=2e-2)
    for g, g_kernel, leaf in zip(ours_grads, kernel_grads, exact):
        torch.testing.assert_close(g.double(), leaf.grad, atol=5e-2, rtol=5e-2)
        assert (g.double() - leaf.grad).abs().max() <= (g_kernel.double() - leaf.grad).abs().max() + 1e-2
    # the path is taken, and autograd keeps exactly the bytes torch's bf16 kernel keeps
    q16 = leaves[0].detach().to(torch.bfloat16)
    assert serves(q16, q16) == torch.bfloat16 and serves(leaves[0], leaves[0]) is None
    inputs = [t.detach().to(torch.bfloat16).requires_grad_() for t in leaves]
    assert _saved_bytes(core, *inputs) == _saved_bytes(sdpa, *inputs)


def test_rotary_compiled_real_form_matches_the_complex_one() -> None:
    """Under torch.compile the rotation is written in real arithmetic (one fused kernel); eager it
    is a complex multiply: the same pairs turned by the same angles."""
    from fivefold.model.attention import apply_rotary

    spec = _spec()
    model = _model(spec)
    positions = torch.arange(12).expand(2, 12)
    x = torch.randn(2, 12, spec.heads, spec.head_dim)
    for dtype in (torch.float32, torch.bfloat16):
        rope = model.model.rotary_emb(positions, dtype)
        eager = apply_rotary(x.to(dtype), rope)
        compiled = torch.compile(apply_rotary, backend="aot_eager", fullgraph=True)(x.to(dtype), rope)
        assert compiled.dtype == eager.dtype == dtype
        torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-6)
