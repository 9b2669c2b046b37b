"""The fused loss inside Hugging Face causal LMs (``fuse_modules(model, loss=True)``): the stock model's loss and
gradients without its logits, Hugging Face's label shift, ignore_index, ``num_items_in_batch`` and ``shift_labels``;
the stock forward wherever the logits are wanted; Trainer trains the same."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn

from ampkernels.float8 import fuse, fuse_modules
from ampkernels.loss import causal_lm

transformers = pytest.importorskip("transformers")

VOCAB = 96  # not a multiple of any tile


def _tiny(device: str = "cpu", cls=None, seed: int = 0) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(seed)
    return (cls or transformers.LlamaForCausalLM)(config).to(device)


def _tokens(device: str = "cpu", seed: int = 1, batch: int = 3, seq: int = 17) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed)).to(device)


def _loss_and_grads(model: nn.Module, **inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters()}


def _assert_close_grads(ours: dict[str, torch.Tensor], stock: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == stock.keys()
    for name in stock:
        # float32 throughout: the chunked head sums the same products in another order
        torch.testing.assert_close(ours[name], stock[name], rtol=2e-5, atol=2e-6, msg=name)


def _fused_loss_only(model: nn.Module) -> nn.Module:
    """``model`` with only its loss fused (the norms and MLPs kept stock), so that the comparison is the loss's."""
    report = fuse_modules(model, loss=True)
    for name, module in model.named_modules():
        if name and getattr(type(module), "_ampkernels_fused", None) is not None:
            module.__class__ = type(module)._ampkernels_fused
    assert ("(the model)", "LlamaForCausalLM") in report.swapped
    return model


@pytest.mark.parametrize("case", ["plain", "ignored labels", "num_items_in_batch", "shift_labels"])
def test_same_loss_and_gradients_as_the_stock_forward(case, device):
    stock = _tiny(device)
    model = _fused_loss_only(copy.deepcopy(stock))
    tokens = _tokens(device)
    labels = tokens.clone()
    inputs = {"input_ids": tokens, "labels": labels}
    if case == "ignored labels":
        labels[0, 5:] = -100
        labels[2, :3] = -100
    elif case == "num_items_in_batch":
        inputs["num_items_in_batch"] = torch.tensor(40, device=device)  # as Trainer counts over micro-batches
    elif case == "shift_labels":
        shifted = torch.randint(0, VOCAB, tokens.shape, generator=torch.Generator().manual_seed(7)).to(device)
        shifted[1, -4:] = -100
        inputs["shift_labels"] = shifted
    ours, ours_grads = _loss_and_grads(model, **inputs)
    theirs, stock_grads = _loss_and_grads(stock, **inputs)
    assert ours.logits is None and theirs.logits is not None
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-6, atol=1e-6)
    _assert_close_grads(ours_grads, stock_grads)


def test_the_logits_are_never_formed(monkeypatch):
    model = _fused_loss_only(_tiny())
    called = []
    model.lm_head.register_forward_hook(lambda *_: called.append(True))
    losses = []
    monkeypatch.setattr(causal_lm, "linear_cross_entropy", _recording(causal_lm.linear_cross_entropy, losses))
    model(input_ids=_tokens(), labels=_tokens()).loss.backward()
    assert called == [] and len(losses) == 1


def test_a_float8_head_runs_the_fused_loss_in_float8(monkeypatch, device):
    """After convert_to_float8, the fused loss runs the tensorwise Float8Linear head's products in FP8: its logits are
    the layer's (the same casts of the hidden states and weight), so the loss is the unfused FP8 model's; its
    gradients (each chunk's logit gradient scaled by its own amax) are no further from the float32 model's than the
    unfused FP8 model's are, within twice."""
    from ampkernels.float8 import Float8Linear, convert_to_float8

    config = transformers.LlamaConfig(
        vocab_size=112,  # (FP8 products take multiples of 16)
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    exact = transformers.LlamaForCausalLM(config).to(device)
    stock = convert_to_float8(copy.deepcopy(exact), "tensorwise", min_features=0)
    assert isinstance(stock.lm_head, Float8Linear)
    model = _fused_loss_only(copy.deepcopy(stock))
    asked = []
    fused = causal_lm.linear_cross_entropy

    def recording(*args, **kwargs):
        asked.append(kwargs["float8"])
        return fused(*args, **kwargs)

    monkeypatch.setattr(causal_lm, "linear_cross_entropy", recording)
    tokens = torch.randint(0, 112, (2, 24), generator=torch.Generator().manual_seed(3)).to(device)
    _, exact_grads = _loss_and_grads(exact, input_ids=tokens, labels=tokens)
    with torch.autocast(device, dtype=torch.bfloat16):
        ours, ours_grads = _loss_and_grads(model, input_ids=tokens, labels=tokens)
        theirs, stock_grads = _loss_and_grads(stock, input_ids=tokens, labels=tokens)
    assert [getattr(recipe, "name", None) for recipe in asked] == ["tensorwise"]
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=1e-5)

    def error(grads, name):
        return ((grads[name] - exact_grads[name]).norm() / exact_grads[name].norm()).item()

    for name in exact_grads:
        assert error(ours_grads, name) <= 2 * error(stock_grads, name) + 1e-3, name


def _recording(fn, calls):
    def wrapper(*args, **kwargs):
        calls.append(True)
        return fn(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("case", ["eval", "no labels", "logits_to_keep"])
def test_stock_forward_where_the_logits_are_wanted(case):
    stock = _tiny()
    model = _fused_loss_only(copy.deepcopy(stock))
    tokens = _tokens()
    inputs = {"input_ids": tokens, "labels": tokens}
    if case == "eval":
        model.eval(), stock.eval()
    elif case == "no labels":
        del inputs["labels"]
    else:
        inputs["logits_to_keep"] = 4
        del inputs["labels"]  # (stock's loss needs every token's logits)
    with torch.no_grad():
        ours, theirs = model(**inputs), stock(**inputs)
    assert ours.logits is not None
    torch.testing.assert_close(ours.logits, theirs.logits, rtol=0, atol=0)
    if "labels" in inputs:
        torch.testing.assert_close(ours.loss, theirs.loss, rtol=0, atol=0)


def test_positional_arguments_and_return_dict_false():
    stock = _tiny()
    model = _fused_loss_only(copy.deepcopy(stock))
    tokens = _tokens()
    mask = torch.ones_like(tokens)
    # (input_ids, attention_mask, position_ids, cache, inputs_embeds, labels) positionally, as the signature orders them
    ours = model(tokens, mask, None, None, None, tokens, return_dict=False)
    theirs = stock(tokens, mask, None, None, None, tokens, return_dict=False)
    assert isinstance(ours, tuple)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-6, atol=1e-6)


def test_under_bf16_autocast_the_error_is_within_twice_stock(device):
    """Against the float32 model's loss, ours under bf16 autocast errs no more than 2x stock under it."""
    stock = _tiny(device)
    model = _fused_loss_only(copy.deepcopy(stock))
    tokens = _tokens(device, batch=4, seq=33)
    with torch.no_grad():
        exact = stock(input_ids=tokens, labels=tokens).loss.double()
        with torch.autocast(device, dtype=torch.bfloat16):
            ours = model(input_ids=tokens, labels=tokens).loss.double()
            theirs = stock(input_ids=tokens, labels=tokens).loss.double()
    assert (ours - exact).abs() <= 2 * (theirs - exact).abs() + 1e-3 * exact.abs()


def test_a_non_llama_forward_is_left_with_the_reason():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    assert not any(cls.endswith("LMHeadModel") for _, cls, _ in fuse_modules(model).left)  # loss=False: not asked
    gemma2 = transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )
    )
    left = {name: why for name, cls, why in fuse_modules(gemma2, loss=True).left}
    assert "soft-capping" in left["(the model)"]
    assert type(gemma2) is transformers.Gemma2ForCausalLM


def test_models_written_from_llama_are_recognized():
    llama = fuse._Llama.load()
    for cls in (transformers.LlamaForCausalLM, transformers.MistralForCausalLM, transformers.Qwen2ForCausalLM):
        assert llama.is_causal_lm(cls), cls.__name__
    assert not llama.is_causal_lm(transformers.GPT2LMHeadModel)
    assert not llama.is_causal_lm(transformers.Gemma2ForCausalLM)


def test_fused_forwards_keep_the_stock_signatures_and_names():
    """Frameworks read the forward's signature (Trainer: the dataset columns it keeps, num_items_in_batch)."""
    stock = _tiny()
    model = copy.deepcopy(stock)
    fuse_modules(model, loss=True)
    pairs = [(model, stock), (model.model.layers[0].self_attn, stock.model.layers[0].self_attn)]
    pairs += [(model.model.layers[0].mlp, stock.model.layers[0].mlp), (model.model.norm, stock.model.norm)]
    for fused, plain in pairs:
        assert type(fused) is not type(plain)
        assert inspect.signature(fused.forward) == inspect.signature(plain.forward), type(plain).__name__
        assert fused.forward.__name__ == "forward" and fused.forward.__doc__ == plain.forward.__doc__


def test_loss_argument_must_be_a_bool():
    with pytest.raises(TypeError, match="'loss'"):
        fuse_modules(_tiny(), loss="yes")


def test_causal_lm_loss_needs_labels():
    with pytest.raises(ValueError, match="'labels'"):
        causal_lm.causal_lm_loss(torch.randn(1, 4, 8), nn.Linear(8, 16), None)


def test_trainer_trains_the_same_with_the_fused_loss(tmp_path, device):
    """Trainer passes ``num_items_in_batch`` (gradient accumulation here): same losses as the stock model's."""
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    def train(model) -> list[float]:
        AcceleratorState._reset_state(True)
        losses = []

        class Recording(transformers.Trainer):
            def training_step(self, *args, **kwargs):
                loss = super().training_step(*args, **kwargs)
                losses.append(loss.item())
                return loss

        data = [{"input_ids": t, "labels": t} for t in _tokens(seed=3, batch=16, seq=12)]  # (Trainer moves them)
        args = transformers.TrainingArguments(
            str(tmp_path),
            max_steps=4,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            learning_rate=1e-3,
            use_cpu=device == "cpu",
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
        )
        Recording(model, args, train_dataset=data).train()
        return losses

    stock = _tiny(device)
    model = _fused_loss_only(copy.deepcopy(stock))
    try:
        theirs = train(stock)
        ours = train(model)
    finally:
        AcceleratorState._reset_state(True)  # (the state is process-wide: later tests make their own Accelerator)
    assert len(ours) == 8
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=1e-6)
