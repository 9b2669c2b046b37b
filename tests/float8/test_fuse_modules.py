"""ampkernels.float8.fuse_modules: stock RMSNorms and gated MLPs put on the fused kernels, the same computation, with
a report of what changed and what was left and why."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ampkernels import dispatch
from ampkernels.float8 import fuse, fuse_modules
from ampkernels.float8.fused import rms_norm

transformers = pytest.importorskip("transformers")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch"] + (["triton"] if dispatch.why_not("float8_fused", "triton", DEV) is None else [])


def _tiny_llama(seed: int = 0) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(DEV)


def _loss_and_grads(model: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_hf_llama_norms_mlps_and_rope_are_fused_and_train_the_same(backend, monkeypatch):
    monkeypatch.setenv("AMPKERNELS_FLOAT8_BACKEND", backend)
    stock = _tiny_llama()
    model = copy.deepcopy(stock)
    report = fuse_modules(model)
    swapped = dict(report.swapped)
    assert swapped == {
        "model.layers.0.self_attn": "LlamaAttention",
        "model.layers.1.self_attn": "LlamaAttention",
        "model.layers.0.input_layernorm": "LlamaRMSNorm",
        "model.layers.0.post_attention_layernorm": "LlamaRMSNorm",
        "model.layers.0.mlp": "LlamaMLP",
        "model.layers.1.input_layernorm": "LlamaRMSNorm",
        "model.layers.1.post_attention_layernorm": "LlamaRMSNorm",
        "model.layers.1.mlp": "LlamaMLP",
        "model.norm": "LlamaRMSNorm",
    }
    assert report.left == []
    # What callers rely on stays: class checks, parameters, state_dict keys, repr.
    norm = model.model.norm
    assert isinstance(norm, type(stock.model.norm)) and type(norm) is not type(stock.model.norm)
    assert type(norm).__name__ == "LlamaRMSNorm" and repr(norm) == repr(stock.model.norm)
    assert list(model.state_dict()) == list(stock.state_dict())
    tokens = torch.randint(128, (2, 24), device=DEV)
    expected_loss, expected = _loss_and_grads(stock, tokens)
    loss, grads = _loss_and_grads(model, tokens)
    # The fused norm and RoPE are the same formulas; SiLU-up rounds once where stock rounds twice (float32 model: ~1
    # ulp).
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-5, msg=name)
    assert str(report).startswith("fuse_modules: 9 module(s) on the fused kernels, 0 left")


def test_the_fused_forwards_run_the_fused_kernels(monkeypatch):
    calls = []
    monkeypatch.setattr(fuse, "rms_norm", lambda *a, **k: calls.append("rms_norm") or rms_norm(*a, **k))
    real_silu_mul, real_rope = fuse.silu_mul, fuse.rotary_embedding
    monkeypatch.setattr(fuse, "silu_mul", lambda *a, **k: calls.append("silu_mul") or real_silu_mul(*a, **k))
    monkeypatch.setattr(fuse, "rotary_embedding", lambda *a, **k: calls.append("rope") or real_rope(*a, **k))
    model = _tiny_llama().train()
    fuse_modules(model)
    model(torch.randint(128, (1, 8), device=DEV))
    assert calls.count("rms_norm") == 5 and calls.count("silu_mul") == 2 and calls.count("rope") == 4  # q, k x 2
    calls.clear()
    model.eval()  # (generation: the cache and the tables' dtype are stock's)
    model(torch.randint(128, (1, 8), device=DEV))
    assert calls.count("rms_norm") == 5 and calls.count("rope") == 0


def test_rope_under_autocast_reads_what_stock_reads():
    """Stock's RoPE under autocast is float32 (the float32 tables promote q and k), cast to bf16 by the attention; the
    fused one rounds to bf16 itself. The attention sees the same values."""
    stock = _tiny_llama().train()
    model = copy.deepcopy(stock)
    report = fuse_modules(model)
    for name, module in model.named_modules():  # only the RoPE fused: the comparison is its own
        if name and not name.endswith("self_attn") and getattr(type(module), "_ampkernels_fused", None) is not None:
            module.__class__ = type(module)._ampkernels_fused
    assert ("model.layers.0.self_attn", "LlamaAttention") in report.swapped
    tokens = torch.randint(128, (2, 24), device=DEV)
    with torch.autocast(DEV, dtype=torch.bfloat16):
        ours, theirs = _loss_and_grads(model, tokens), _loss_and_grads(stock, tokens)
    torch.testing.assert_close(ours[0], theirs[0], rtol=2e-3, atol=2e-3)
    for name, grad in ours[1].items():
        torch.testing.assert_close(grad, theirs[1][name], rtol=2e-2, atol=2e-3, msg=name)


def test_rope_with_unknown_tables_is_left_with_the_reason():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    class InterleavedRotary(LlamaRotaryEmbedding):
        def forward(self, x, position_ids):
            cos, sin = super().forward(x, position_ids)
            return cos.flip(-1), sin.flip(-1)

    model = _tiny_llama()
    model.model.rotary_emb.__class__ = InterleavedRotary
    report = fuse_modules(model)
    left = {name: why for name, _, why in report.left}
    assert "not Llama's" in left["model.layers.0.self_attn"] and "InterleavedRotary" in left["model.layers.0.self_attn"]
    assert left["model.rotary_emb"].startswith("the attentions keep stock's RoPE")
    assert "model.layers.0.self_attn" not in dict(report.swapped)


def test_fusing_twice_changes_nothing_more():
    model = _tiny_llama()
    first = fuse_modules(model)
    classes = {name: type(m) for name, m in model.named_modules()}
    second = fuse_modules(model)
    assert second.swapped == [] and second.left == first.left
    assert classes == {name: type(m) for name, m in model.named_modules()}


def test_a_fused_model_pickles_and_copies():
    model = _tiny_llama()
    fuse_modules(model)
    tokens = torch.randint(128, (1, 8), device=DEV)
    expected = model(tokens).logits
    copied = pickle.loads(pickle.dumps(copy.deepcopy(model)))
    torch.testing.assert_close(copied(tokens).logits, expected, rtol=0, atol=0)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    saved = dict(fuse._FUSED_CLASSES)
    fuse._FUSED_CLASSES.clear()  # as in a new process: the class is rebuilt from its pickled name
    try:
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert type(loaded.model.norm).__name__ == "LlamaRMSNorm" and type(loaded.model.norm)._ampkernels_fused
        assert type(loaded.model.norm) is not type(model.model.norm)  # rebuilt, not found in memory
        torch.testing.assert_close(loaded(tokens).logits, expected, rtol=0, atol=0)
    finally:
        fuse._FUSED_CLASSES.clear()
        fuse._FUSED_CLASSES.update(saved)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_torch_rms_norm_is_fused_on_float32_and_stock_otherwise(monkeypatch):
    calls = []
    monkeypatch.setattr(fuse, "rms_norm", lambda *a, **k: calls.append(a[2]) or rms_norm(*a, **k))
    norm = nn.RMSNorm(48, device=DEV)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    stock = copy.deepcopy(norm)
    report = fuse_modules(norm)
    assert report.swapped == [("(the model)", "RMSNorm")]
    x = torch.randn(3, 7, 48, device=DEV)
    torch.testing.assert_close(norm(x), stock(x), rtol=1e-6, atol=1e-6)
    assert calls == [torch.finfo(torch.float32).eps]  # eps=None: torch's default for a float32 input
    # bfloat16: F.rms_norm multiplies by the weight before rounding, the fused kernel after: stock's code runs.
    calls.clear()
    x16 = x.bfloat16()
    assert torch.equal(norm(x16), stock(x16)) and calls == []
    assert torch.equal(norm(x16), F.rms_norm(x16, (48,), stock.weight))


def test_what_cannot_be_proved_is_left_with_the_reason():
    class GemmaLikeRMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(8))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1 + self.weight)

    config = transformers.LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, hidden_act="gelu")
    model = nn.ModuleDict(
        {
            "plain": nn.RMSNorm(8, elementwise_affine=False),
            "two_dims": nn.RMSNorm((4, 8)),
            "gemma": GemmaLikeRMSNorm(),
            "gelu_mlp": transformers.models.llama.modeling_llama.LlamaMLP(config),
        }
    )
    report = fuse_modules(model)
    assert report.swapped == []
    reasons = {name: why for name, _, why in report.left}
    assert reasons["plain"].startswith("no weight")
    assert reasons["two_dims"].startswith("normalizes over 2 dimensions")
    assert "not Llama's RMSNorm" in reasons["gemma"]
    assert reasons["gelu_mlp"].startswith("its activation is")


def test_a_fused_llama_compiles_with_inductor_and_trains_the_same():
    """fuse_modules, then torch.compile's default backend (Inductor): the fused norms, MLPs, RoPE and loss lower, and
    the loss and gradients are the eager fused model's."""
    model = _tiny_llama()
    fuse_modules(model, loss=True)
    tokens = torch.randint(128, (2, 24), device=DEV)
    expected_loss, expected = _loss_and_grads(model, tokens)
    compiled = torch.compile(model)
    loss, grads = _loss_and_grads(compiled, tokens)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name.removeprefix("_orig_mod.")], rtol=1e-4, atol=1e-5, msg=name)
