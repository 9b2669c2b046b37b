"""Whole-step CUDA graphs: ``ampkernels.capture_step`` replays forward + backward + scaler + optimizer, overflow steps
are still skipped and the scale still updated; its warm-up and capture leave the model, optimizer, scaler and random
number generators as they were, so a graphed run equals the eager run from the same seed; capture with an ordinary
optimizer fails with a clear error."""

from __future__ import annotations

import copy
import gc
import math
import sys

import pytest
import torch

import ampkernels
from ampkernels import FusedGradScaler, capture_step

OVERFLOW_STEPS = {2, 5}


def _optimizers():
    kinds = {
        "torch-fused-adamw": lambda params: torch.optim.AdamW(
            params, lr=torch.tensor(1e-2, device="cuda"), fused=True, capturable=True
        )
    }
    for name in ("FusedAdamW", "FusedSGD"):
        if hasattr(ampkernels, name):
            cls = getattr(ampkernels, name)
            kinds[name] = lambda params, cls=cls: cls(params, lr=torch.tensor(1e-2, device="cuda"))
    if hasattr(ampkernels, "FusedAdamW"):  # the blockwise step: the first Linear's weight gets quantized moments
        kinds["FusedAdamW-8bit"] = lambda params: ampkernels.FusedAdamW(
            params, lr=torch.tensor(1e-2, device="cuda"), exp_avg_dtype="8bit", exp_avg_sq_dtype="8bit"
        )
        kinds["FusedAdamW-4bit-bf16"] = lambda params: ampkernels.FusedAdamW(
            params, lr=torch.tensor(1e-2, device="cuda"), exp_avg_dtype="bf16", exp_avg_sq_dtype="4bit"
        )
    return kinds


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(  # 32 x 128: 4096 weights, the smallest tensor with quantized moments
        torch.nn.Linear(32, 128), torch.nn.LayerNorm(128), torch.nn.GELU(), torch.nn.Linear(128, 8)
    ).cuda()


def _batches(n):
    gen = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for step in range(n):
        x = torch.randn(16, 32, device="cuda", generator=gen)
        if step in OVERFLOW_STEPS:
            x[3, 7] = math.inf  # every gradient of the step becomes non-finite: the step must be skipped
        out.append((x, torch.randn(16, 8, device="cuda", generator=gen)))
    return out


def _make_step(model, opt, scaler):
    def train_step(x, y):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.clip_grad_norm_(opt, max_norm=1.0)
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    return train_step


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(_optimizers()) if torch.cuda.is_available() else ["torch-fused-adamw"])
def test_replay_matches_eager_and_skips_overflow(kind):
    make_opt = _optimizers()[kind]
    batches = _batches(8)
    warm_x, warm_y = _batches(1)[0]

    eager_model = _model()
    graph_model = copy.deepcopy(eager_model)
    eager_opt, graph_opt = make_opt(eager_model.parameters()), make_opt(graph_model.parameters())
    eager_scaler, graph_scaler = FusedGradScaler(init_scale=2.0**14), FusedGradScaler(init_scale=2.0**14)
    eager_step = _make_step(eager_model, eager_opt, eager_scaler)

    graphed = capture_step(_make_step(graph_model, graph_opt, graph_scaler), warm_x, warm_y, warmup=3)
    # Warm-up and capture left everything as it was: the models agree before the first replay.
    for a, b in zip(eager_model.parameters(), graph_model.parameters()):
        assert torch.equal(a, b)
    assert graph_scaler.get_scale() == 2.0**14

    for step, (x, y) in enumerate(batches):
        before = [p.detach().clone() for p in graph_model.parameters()]
        scale_before = graph_scaler.get_scale()
        eager_loss = eager_step(x, y)
        graph_loss = graphed(x, y)
        if step in OVERFLOW_STEPS:
            assert all(torch.equal(b, p) for b, p in zip(before, graph_model.parameters())), "overflow not skipped"
            assert graph_scaler.get_scale() == scale_before / 2
        else:
            assert not torch.equal(before[0], graph_model[0].weight)
        assert graph_scaler.get_scale() == eager_scaler.get_scale()
        # The same kernels on the same values in the same order: equal bit for bit.
        torch.testing.assert_close(graph_loss, eager_loss, rtol=0, atol=0, equal_nan=True)
        for a, b in zip(eager_model.parameters(), graph_model.parameters()):
            assert torch.equal(b, a), f"step {step}"


@pytest.mark.gpu
def test_capture_with_an_ordinary_optimizer_says_what_to_use():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # foreach: its step needs the skip decision on the host
    x, y = _batches(1)[0]
    with pytest.raises(RuntimeError, match="FusedAdamW"):
        capture_step(_make_step(model, opt, FusedGradScaler()), x, y, warmup=1)


@pytest.mark.gpu
def test_failed_capture_leaves_the_training_state_as_it_was():
    """A step that cannot be captured fails after its warm-up steps ran, and its capture got as far as the clip
    (the scaler's stage "unscaled", gradients in the graph's pool). The error must leave the model, optimizer and
    scaler as they were, so that an eager fallback on the same step function trains as if capture_step had never
    been called."""
    model = _model()
    fresh = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # foreach: its step needs the skip decision on the host
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    scaler, fresh_scaler = FusedGradScaler(init_scale=2.0**10), FusedGradScaler(init_scale=2.0**10)
    step, fresh_step = _make_step(model, opt, scaler), _make_step(fresh, fresh_opt, fresh_scaler)
    batches = _batches(5)
    with pytest.raises(RuntimeError, match="FusedAdamW"):
        capture_step(step, *batches[0], warmup=2)
    assert all(p.grad is None for p in model.parameters())
    assert scaler.get_scale() == 2.0**10 and not scaler._per_optimizer_states
    for x, y in batches[1:]:  # (an overflow step among them)
        torch.testing.assert_close(step(x, y), fresh_step(x, y), rtol=0, atol=0, equal_nan=True)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters(), strict=True))
    assert scaler.get_scale() == fresh_scaler.get_scale()


@pytest.mark.gpu
def test_captured_step_checks_its_inputs():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2, device="cuda"), fused=True, capturable=True)
    x, y = _batches(1)[0]
    graphed = capture_step(_make_step(model, opt, FusedGradScaler()), x, y, warmup=1)
    with pytest.raises(ValueError, match=r"input 0 must be a tensor of shape \(16, 32\)"):
        graphed(x[:8], y)
    with pytest.raises(ValueError, match="argument structure"):
        graphed(x)


@pytest.mark.gpu
def test_captured_step_matches_keyword_arguments_by_name():
    """A replay given the keyword arguments in another order than the capture (a call matches them by name) copies
    each into its own input; it was refused as "another argument structure"."""
    a, b = torch.arange(4.0, device="cuda"), torch.full((4,), 10.0, device="cuda")
    graphed = capture_step(lambda a, b: a * 2 + b, a=a, b=b, warmup=1, restore=False)
    a1, b1 = torch.randn(4, device="cuda"), torch.randn(4, device="cuda")
    assert torch.equal(graphed(b=b1, a=a1), a1 * 2 + b1)
    assert torch.equal(graphed(a=b1, b=a1), b1 * 2 + a1)
    with pytest.raises(ValueError, match="input 1 must be a tensor of shape"):
        graphed(b=b1[:3], a=a1)


def test_capture_step_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("checks the error without a CUDA device")
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
        capture_step(lambda x: x, torch.ones(1))


@pytest.mark.gpu
def test_long_replay_with_growth_and_overflows_matches_eager():
    """150 replays with scale growth every 10 steps and overflows injected through an input: the scale history and
    the losses of the graphed step equal the eager step's (a graph that lost its model's memory drifts here, see
    test_captured_step_keeps_what_its_step_function_owns_alive)."""
    if not hasattr(ampkernels, "FusedAdamW"):
        pytest.skip("needs the native fused optimizers")
    steps, overflow = 150, {20, 21, 90}
    gen = torch.Generator(device="cuda").manual_seed(3)
    xs = [torch.randn(16, 32, device="cuda", generator=gen) for _ in range(steps + 1)]
    ys = [torch.randn(16, 8, device="cuda", generator=gen) for _ in range(steps + 1)]

    def run(graphed: bool):
        model = _model()
        opt = ampkernels.FusedAdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        scaler = FusedGradScaler(init_scale=2.0**10, growth_interval=10)
        train_step = _make_step(model, opt, scaler)

        def step(x, y, poison):
            return train_step(x * poison, y)

        one = torch.ones((), device="cuda")
        if graphed:
            step = capture_step(step, xs[0], ys[0], one)
        losses, scales = [], []
        for i in range(1, steps + 1):
            poison = torch.full((), math.inf if i in overflow else 1.0, device="cuda")
            losses.append(step(xs[i], ys[i], poison).clone())
            scales.append(scaler._scale.clone())
            torch.empty(1024, device="cuda")  # eager allocations between replays, as a training loop makes
        return torch.stack(losses).cpu(), torch.stack(scales).cpu()

    eager_losses, eager_scales = run(graphed=False)
    graph_losses, graph_scales = run(graphed=True)
    assert torch.equal(graph_scales, eager_scales)
    torch.testing.assert_close(graph_losses, eager_losses, rtol=0, atol=0, equal_nan=True)


def test_transformers_mask_skip_hides_capture_from_transformers_and_restores(monkeypatch):
    import types

    from ampkernels.cuda_graph import transformers_mask_skip

    def capturing():
        return True

    fake = types.ModuleType("transformers.utils.import_utils")
    fake.is_cuda_stream_capturing = capturing
    monkeypatch.setitem(sys.modules, "transformers.utils.import_utils", fake)
    with transformers_mask_skip():
        assert fake.is_cuda_stream_capturing() is False
    assert fake.is_cuda_stream_capturing is capturing
    with pytest.raises(ValueError), transformers_mask_skip():  # restored when the capture raises
        raise ValueError
    assert fake.is_cuda_stream_capturing is capturing
    monkeypatch.delitem(sys.modules, "transformers.utils.import_utils")
    with transformers_mask_skip():  # transformers not imported: nothing to do
        pass


@pytest.mark.gpu
def test_captured_bert_step_keeps_maskless_attention_and_matches_eager(monkeypatch):
    """transformers materializes an attention mask while a stream captures; with transformers_mask_skip=True the
    captured step calls SDPA without a mask, as eager does, and its losses equal the eager step's."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=512,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    masks = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        masks.append(kwargs.get("attn_mask", args[3] if len(args) > 3 else None))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    gen = torch.Generator(device="cuda").manual_seed(5)
    batches = [torch.randint(0, 512, (4, 64), device="cuda", generator=gen) for _ in range(6)]

    def run(graphed: bool):
        torch.manual_seed(0)
        model = transformers.BertForMaskedLM(config).cuda().train()
        opt = ampkernels.FusedAdamW(model.parameters(), lr=1e-3)
        scaler = FusedGradScaler()

        def step(ids):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(input_ids=ids, labels=ids).loss
            scaler.scale(loss).backward()
            scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()
            return loss.detach()

        if graphed:
            masks.clear()
            step = capture_step(step, batches[0], transformers_mask_skip=True)
            assert masks and all(m is None for m in masks), "the captured attention got a mask"
        return torch.stack([step(ids).clone() for ids in batches[1:]]).cpu()

    torch.testing.assert_close(run(graphed=True), run(graphed=False), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_captured_step_keeps_what_its_step_function_owns_alive():
    """A step built by a helper is often the only owner of its model and optimizer. The captured step must keep it
    alive: the graph writes their memory at every replay (else eager allocations take the freed parameter memory and
    the replays corrupt them: a drifting scale, NaN losses, an out-of-range gather)."""
    if not hasattr(ampkernels, "FusedAdamW"):
        pytest.skip("needs the native fused optimizers")
    batches = _batches(12)

    def build():
        model = _model()
        opt = ampkernels.FusedAdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        return _make_step(model, opt, FusedGradScaler(init_scale=2.0**10)), model

    eager_step, _ = build()
    eager = torch.stack([eager_step(x, y).clone() for x, y in batches[1:]])

    graphed = capture_step(build()[0], *batches[0])  # the model and optimizer now live only in the step's closure
    gc.collect()
    # Allocations the size of every parameter and state tensor, filled with garbage: they take any freed block.
    sizes = [p.numel() for p in _model().parameters()] * 6
    squatters = [torch.full((n,), 7.0, device="cuda") for n in sizes]
    losses = []
    for x, y in batches[1:]:
        losses.append(graphed(x, y).clone())
        squatters.append(torch.full((64,), 7.0, device="cuda"))
    torch.testing.assert_close(torch.stack(losses), eager, rtol=1e-4, atol=1e-6, equal_nan=True)  # overflow steps
    assert all(bool((s == 7.0).all()) for s in squatters), "a replay wrote into memory the graph does not own"


@pytest.mark.gpu
def test_two_graphs_over_one_optimizer_replay_correctly_after_each_other():
    """Two captured steps (two batch sizes) share one model, scaler and FusedAdamW. Capturing the second moves the
    gradients and re-uploads the launch tables; the first graph still reads its own upload's pinned host source at
    every replay, which must stay alive (it is retained): replaying both in turn, with an eager step in between,
    equals the same steps eagerly. Pinned allocations filled with garbage would take a freed source."""
    if not hasattr(ampkernels, "FusedAdamW"):
        pytest.skip("needs the native fused optimizers")
    gen = torch.Generator(device="cuda").manual_seed(11)
    big = [(torch.randn(16, 32, device="cuda", generator=gen), torch.randn(16, 8, device="cuda", generator=gen))
           for _ in range(7)]  # fmt: skip
    small = [(x[:5].clone(), y[:5].clone()) for x, y in big]

    def build():
        model = _model()
        opt = ampkernels.FusedAdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        return _make_step(model, opt, FusedGradScaler(init_scale=2.0**10))

    # Replays of both graphs in turn, and one eager step of the same step function in between (its gradients land
    # in ordinary memory and the launch tables move there; the graphs must keep reading their own).
    plan = [("big", 1), ("small", 1), ("big", 2), ("eager", 3), ("small", 2), ("big", 4), ("small", 5), ("big", 6)]
    batches = {"big": big, "small": small, "eager": big}

    eager_step = build()
    eager = [eager_step(*batches[kind][i]).clone() for kind, i in plan]

    step = build()
    graphs = {"big": capture_step(step, *big[0]), "small": capture_step(step, *small[0]), "eager": step}
    squatters = [torch.full((n,), -1, dtype=torch.int64).pin_memory() for n in (64, 128, 256, 512, 1024) * 8]
    graphed = [graphs[kind](*batches[kind][i]).clone() for kind, i in plan]
    del squatters
    torch.testing.assert_close(torch.stack(graphed), torch.stack(eager), rtol=1e-4, atol=1e-6)


def _bn_dropout_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.BatchNorm1d(128), torch.nn.GELU(), torch.nn.Dropout(0.25),
        torch.nn.Linear(128, 8),
    ).cuda()  # fmt: skip


def _state_of(model, opt, scaler):
    """Everything a step writes, cloned: parameters, buffers, optimizer state, scale and growth tracker."""
    tensors = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    for p in model.parameters():
        for value in opt.state.get(p, {}).values():
            if isinstance(value, torch.Tensor):
                tensors.append(value.detach().clone())
    if scaler._scale is not None:
        tensors += [scaler._scale.clone(), scaler._growth_tracker.clone()]
    return tensors


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(_optimizers()) if torch.cuda.is_available() else ["torch-fused-adamw"])
@pytest.mark.parametrize("how", ["found", "explicit"])
def test_capture_leaves_the_training_state_untouched_and_replays_the_eager_run(kind, how):
    """BatchNorm statistics, dropout masks (the CUDA generator), lazily created optimizer state and the lazily
    created scale: after capture_step everything equals a fresh copy that never ran, and the graphed run (losses,
    parameters, buffers, scale) equals the eager run bit for bit, the first replay being the first step."""
    make_opt = _optimizers()[kind]
    gen = torch.Generator(device="cuda").manual_seed(2)  # finite batches: an inf would poison the BatchNorm stats
    batches = [(torch.randn(16, 32, device="cuda", generator=gen), torch.randn(16, 8, device="cuda", generator=gen))
               for _ in range(10)]  # fmt: skip

    def build():
        model = _bn_dropout_model()
        return model, make_opt(model.parameters()), FusedGradScaler(init_scale=2.0**14, growth_interval=3)

    eager_model, eager_opt, eager_scaler = build()
    graph_model, graph_opt, graph_scaler = build()
    initial = _state_of(graph_model, graph_opt, graph_scaler)
    step = _make_step(graph_model, graph_opt, graph_scaler)
    explicit = dict(models=graph_model, optimizers=[graph_opt], scalers=graph_scaler) if how == "explicit" else {}
    torch.cuda.manual_seed(7)
    graphed = capture_step(step, *batches[0], **explicit)
    assert graph_scaler.get_scale() == 2.0**14 and int(graph_scaler._growth_tracker) == 0
    created = _state_of(graph_model, graph_opt, graph_scaler)[len(initial) : -2]
    assert created or kind == "FusedSGD"  # without momentum, SGD keeps no state
    assert all(int(t.count_nonzero()) == 0 for t in created), "lazily created state is not fresh (zeros, step 0)"
    for a, b in zip(_state_of(graph_model, graph_opt, graph_scaler), initial):
        assert torch.equal(a, b)

    # A replay draws its dropout masks from the generator's state at replay time, as an eager step does: replay
    # first (capture_step left the generator at seed 7, offset 0), then rewind it for the eager run.
    replayed = [graphed(x, y).clone() for x, y in batches[1:]]
    eager_step = _make_step(eager_model, eager_opt, eager_scaler)
    torch.cuda.manual_seed(7)
    eager = [eager_step(x, y).clone() for x, y in batches[1:]]
    torch.testing.assert_close(torch.stack(replayed), torch.stack(eager), rtol=0, atol=0, equal_nan=True)
    assert graph_scaler.get_scale() == eager_scaler.get_scale()
    for a, b in zip(graph_model.state_dict().values(), eager_model.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_capture_with_restore_false_trains_on_the_example_batch():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2, device="cuda"), fused=True, capturable=True)
    scaler = FusedGradScaler()
    before = model[0].weight.detach().clone()
    capture_step(_make_step(model, opt, scaler), *_batches(1)[0], warmup=2, restore=False)
    assert not torch.equal(model[0].weight, before)
    assert float(opt.state[model[0].weight]["step"]) == 2.0


@pytest.mark.gpu
def test_capture_warns_when_it_finds_nothing_to_restore():
    with pytest.warns(UserWarning, match="found no model, optimizer or scaler"):
        capture_step(lambda t: t * 2, torch.ones(4, device="cuda"), warmup=1)


@pytest.mark.gpu
def test_capture_with_master_weights_replays_the_eager_run():
    """bf16 parameters with float32 masters: the restore after warm-up must not look like a load to the optimizer
    (which would record a master resync into the graph and replay it every step): graphed equals eager exactly."""
    if not hasattr(ampkernels, "FusedAdamW"):
        pytest.skip("needs the native fused optimizers")
    batches = _batches(9)

    def build():
        model = _model().to(torch.bfloat16)
        opt = ampkernels.FusedAdamW(model.parameters(), lr=1e-3, weight_decay=0.01, master_weights=True)
        return model, opt, FusedGradScaler(init_scale=2.0**10, growth_interval=3)

    eager_model, eager_opt, eager_scaler = build()
    graph_model, graph_opt, graph_scaler = build()
    eager_step = _make_step(eager_model, eager_opt, eager_scaler)
    graphed = capture_step(_make_step(graph_model, graph_opt, graph_scaler), *batches[0])
    eager = [eager_step(x, y).clone() for x, y in batches[1:]]
    replayed = [graphed(x, y).clone() for x, y in batches[1:]]
    torch.testing.assert_close(torch.stack(replayed), torch.stack(eager), rtol=0, atol=0, equal_nan=True)
    for p, q in zip(graph_model.parameters(), eager_model.parameters(), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(graph_opt.state[p]["master_param"], eager_opt.state[q]["master_param"])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["torch-SGD->FusedSGD", "torch-AdamW->FusedAdamW-8bit", "fresh-FusedAdamW-4bit"])
def test_capture_of_a_converted_state_replays_the_eager_run_and_saves_it(kind):
    """State the first step converts (a torch checkpoint: SGD's momentum buffer without a step count, float moments
    into 8-bit codes) or creates with values other than zeros (the code widths of quantized moments): the graphed
    run equals the eager run from the same state, and after replays alone (no eager step) the optimizer's
    state_dict loads and resumes eagerly as the graph goes on."""
    if not hasattr(ampkernels, "FusedAdamW"):
        pytest.skip("needs the native fused optimizers")
    batches = _batches(8)
    source, _, target = kind.partition("->")
    saved = None
    if target:
        model = _model()
        torch_opt = (
            torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
            if source == "torch-SGD"
            else torch.optim.AdamW(model.parameters(), lr=1e-2)
        )
        _make_step(model, torch_opt, FusedGradScaler(init_scale=2.0**10))(*batches[0])
        saved = torch_opt.state_dict()

    def build():
        model = _model()
        lr = torch.tensor(1e-2, device="cuda")
        if kind.endswith("FusedSGD"):
            opt = ampkernels.FusedSGD(model.parameters(), lr=lr, momentum=0.9)
        else:
            bits = "4bit" if kind.endswith("4bit") else "8bit"
            opt = ampkernels.FusedAdamW(model.parameters(), lr=lr, exp_avg_dtype=bits, exp_avg_sq_dtype=bits)
        if saved is not None:
            opt.load_state_dict(copy.deepcopy(saved))
        return model, opt, FusedGradScaler(init_scale=2.0**10)

    eager_model, eager_opt, eager_scaler = build()
    graph_model, graph_opt, graph_scaler = build()
    eager_step = _make_step(eager_model, eager_opt, eager_scaler)
    graphed = capture_step(_make_step(graph_model, graph_opt, graph_scaler), *batches[0])
    eager = [eager_step(x, y).clone() for x, y in batches[1:5]]
    replayed = [graphed(x, y).clone() for x, y in batches[1:5]]
    torch.testing.assert_close(torch.stack(replayed), torch.stack(eager), rtol=0, atol=0, equal_nan=True)
    for p, q in zip(graph_model.parameters(), eager_model.parameters(), strict=True):
        assert torch.equal(p, q)

    resumed_model, resumed_opt, resumed_scaler = build()
    resumed_model.load_state_dict(graph_model.state_dict())
    resumed_opt.load_state_dict(copy.deepcopy(graph_opt.state_dict()))
    resumed_scaler.load_state_dict(graph_scaler.state_dict())
    resumed_step = _make_step(resumed_model, resumed_opt, resumed_scaler)
    for x, y in batches[5:]:
        torch.testing.assert_close(resumed_step(x, y), graphed(x, y), rtol=0, atol=0, equal_nan=True)
    for p, q in zip(graph_model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)
