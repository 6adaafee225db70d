"""Capture failures name the line that broke (not the decorator the model was entered through)
and, for the causes real models hit, say what to do; following the advice then works."""

from __future__ import annotations

import copy
import functools
import inspect
import threading

import pytest
import torch
from torch import nn

import remat_pass
from remat_pass import CaptureError
from remat_pass.capture.capture_errors import CaptureCause, _last_frame_in_text

from .helpers import (
    TRANSFORMERS_ONE_GRAPH_MOE_AND_OPT,
    assert_same_step,
    eager_reference,
    run_step,
    transformers_older_than,
)


def entry_decorator(forward):
    """Like transformers' ``can_return_tuple``: the first frame under "from user code:"."""

    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        return forward(*args, **kwargs)

    return wrapper


_HOOK_LOCK = threading.Lock()


class LazyHooksUnderALock(nn.Module):
    """Installs its hooks on the first call under a lock, as transformers' output capturing does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.hooks_installed = False

    @entry_decorator
    def forward(self, x):
        if not self.hooks_installed:
            with _HOOK_LOCK:
                self.hooks_installed = True
        return self.fc(x).tanh()


class LocksOnEveryCall(LazyHooksUnderALock):
    """Takes the lock on every call: a warm-up does not help, so the advice is all there is."""

    @entry_decorator
    def forward(self, x):
        with _HOOK_LOCK:
            self.hooks_installed = True
        return self.fc(x).tanh()


class SetsRequiresGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Linear(4, 4)
        self.fc = nn.Linear(4, 4)
        self.encoder_trainable = True

    @entry_decorator
    def forward(self, x):
        h = self.conv(x)
        if not self.encoder_trainable:
            h = h.detach()
            h.requires_grad = True
        return self.fc(h).tanh()


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(4, 4, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0].tanh()


class NonzeroRouting(nn.Module):
    """Eager mixture-of-experts routing: which experts run depends on the values."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(4, 2)
        self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    @entry_decorator
    def forward(self, x):
        chosen = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for expert in torch.nonzero(torch.bincount(chosen, minlength=2))[:, 0]:
            out = out + self.experts[expert](x)
        return out


def _line_of(model_class, text: str) -> int:
    lines, first = inspect.getsourcelines(inspect.unwrap(model_class.forward))
    return first + next(i for i, line in enumerate(lines) if text in line)


def _capture_error(model, x) -> CaptureError:
    with pytest.raises(CaptureError) as raised:
        remat_pass.optimize(model, budget=0.5)(x)
    return raised.value


CASES = [
    (LocksOnEveryCall, "with _HOOK_LOCK:", CaptureCause.LOCK, "takes the lock on every call"),
    (SetsRequiresGrad, "h.requires_grad = True", CaptureCause.REQUIRES_GRAD_SET, "freeze_feature_encoder()"),
    (Recurrent, "return self.rnn(x)", CaptureCause.RNN, "allow_rnn = True"),
    (NonzeroRouting, "for expert in torch.nonzero", CaptureCause.DATA_DEPENDENT, "remat_pass.backend"),
]


@pytest.mark.parametrize("model_class, line, cause, advice", CASES, ids=[c[2].value for c in CASES])
def test_failure_names_the_breaking_line_and_what_to_do(model_class, line, cause, advice):
    torch.manual_seed(0)
    model = model_class()
    if model_class is SetsRequiresGrad:
        model.encoder_trainable = False
    error = _capture_error(model, torch.randn(3, 2, 4))
    message = str(error)
    assert error.diagnosis.cause is cause
    frame = error.diagnosis.frame
    assert frame.filename == __file__ and frame.lineno == _line_of(model_class, line), message
    assert f'line {frame.lineno}, in forward\n    {line}' in message
    assert "wrapper" not in message.split("What to do")[0], "named the entry decorator instead of the line"
    assert advice in message


def test_following_the_lock_advice_warm_up_once_then_optimize():
    torch.manual_seed(0)
    model, x = LazyHooksUnderALock(), torch.randn(3, 4)
    with torch.no_grad():
        model(x)  # the warm-up the message asks for: hooks installed, the lock is not entered again
    loss = lambda out, *_: out.sum()  # noqa: E731
    expected = eager_reference(model, (x,), loss)
    assert_same_step(run_step(model, remat_pass.optimize(model, budget=0.5), (x,), loss), expected)


def test_optimize_warms_up_a_first_call_lock_itself(caplog):
    """Mixtral-style: hooks installed under a lock on the first call; optimize runs the warm-up."""
    torch.manual_seed(0)
    model, x = LazyHooksUnderALock(), torch.randn(3, 4)
    loss = lambda out, *_: out.sum()  # noqa: E731
    expected = eager_reference(copy.deepcopy(model), (x,), loss)
    with caplog.at_level("WARNING", logger="remat_pass.runtime.api"):
        actual = run_step(model, remat_pass.optimize(model, budget=0.5), (x,), loss)
    assert_same_step(actual, expected)
    assert model.hooks_installed and any("warm-up forward" in r.getMessage() for r in caplog.records)


class SideEffectInCheckpoint(nn.Module):
    """A checkpointed block whose forward sets and resets outside state, as transformers 5.2x's hub
    kernel wrapper does around every attention forward (a graph break per layer before)."""

    active: list[object] = []

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def _block(self, block, x):
        SideEffectInCheckpoint.active.append(block)
        try:
            return torch.tanh(block(x))
        finally:
            SideEffectInCheckpoint.active.pop()

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(self._block, block, x, use_reentrant=False)
        return x


def test_a_checkpoint_region_with_python_side_effects_is_one_graph():
    torch.manual_seed(0)
    model, x = SideEffectInCheckpoint(), torch.randn(4, 8)
    loss = lambda out, *_: out.square().sum()  # noqa: E731
    expected = eager_reference(model, (x,), loss)
    optimized = remat_pass.optimize(model, budget=0.5)  # fullgraph: a break would raise
    assert_same_step(run_step(model, optimized, (x,), loss), expected)
    assert len(optimized.pieces) == 1 and not SideEffectInCheckpoint.active


def test_following_the_rnn_advice_allow_rnn():
    torch.manual_seed(0)
    model, x = Recurrent(), torch.randn(2, 3, 4)
    loss = lambda out, *_: out.square().sum()  # noqa: E731
    expected = eager_reference(model, (x,), loss)
    with torch._dynamo.config.patch(allow_rnn=True):
        optimized = remat_pass.optimize(model, budget=1.0)
        actual = run_step(model, optimized, (x,), loss)
    assert_same_step(actual, expected)
    assert actual.saved_bytes == optimized.plan.kept_bytes


def test_unrecognized_failures_get_the_general_advice():
    class Opaque(nn.Module):
        def forward(self, x):
            return torch.tensor(sorted(x.tolist())) * x  # .tolist() is data-dependent but not in the table's words

    error = _capture_error(Opaque(), torch.randn(4, requires_grad=True))
    assert error.diagnosis.frame is not None and "sorted(x.tolist())" in str(error)
    assert "remat_pass.backend" in str(error)


def test_frame_from_text_when_the_exception_has_no_stack():
    text = (
        "Unsupported context manager\n  Explanation: ...\nfrom user code:\n"
        '   File "/lib/generic.py", line 10, in wrapper\n    out = fn(*a, **k)\n          ^^^^^\n'
        '  File "/model.py", line 42, in forward\n    with lock:\n'
        "Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace"
    )
    frame = _last_frame_in_text(text)
    assert (frame.filename, frame.lineno, frame.name, frame.line) == ("/model.py", 42, "forward", "with lock:")
    assert _last_frame_in_text("no user code here") is None


def _tiny_wav2vec2():
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    torch.manual_seed(0)
    config = Wav2Vec2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                            conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                            num_conv_pos_embedding_groups=2, vocab_size=16, mask_time_prob=0.0,
                            do_stable_layer_norm=True, feat_extract_norm="layer")
    return Wav2Vec2ForCTC(config)


@pytest.mark.slow
def test_wav2vec2_failures_point_into_the_model_and_the_advice_works():
    model, audio = _tiny_wav2vec2(), torch.randn(2, 400)
    error = _capture_error(model, audio)
    assert error.diagnosis.cause is CaptureCause.REQUIRES_GRAD_SET
    assert error.diagnosis.frame.filename.endswith("modeling_wav2vec2.py") and "freeze_feature_encoder" in str(error)
    model.freeze_feature_encoder()
    torch._dynamo.reset()
    error = _capture_error(model, audio)
    assert error.diagnosis.cause is CaptureCause.LAYERDROP and "layerdrop = 0.0" in str(error)
    model.config.layerdrop = 0.0
    torch._dynamo.reset()
    optimized = remat_pass.optimize(model, budget=0.5)
    optimized(audio).logits.sum().backward()
    assert optimized.plan.kept_bytes <= 0.5 * optimized.plan.keep_all_bytes


class _OwnLoss(nn.Module):
    """A causal LM returning its own loss (``labels=`` its inputs): Mixtral's with the router's auxiliary loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=input_ids).loss


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_mixtral_with_router_logits_is_warmed_up_and_captured_whole():
    """Held out: transformers registers its output-capturing hooks on the first call that asks for
    router logits, which failed capture ("setattr() on unsupported type" in torch/utils/hooks.py)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    if transformers_older_than(TRANSFORMERS_ONE_GRAPH_MOE_AND_OPT):
        pytest.skip(f"Mixtral routes its experts data-dependently before transformers {TRANSFORMERS_ONE_GRAPH_MOE_AND_OPT}")
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=32, use_cache=False, attn_implementation="sdpa",
                           output_router_logits=True, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    model, tokens = _OwnLoss(MixtralForCausalLM(config).train()), torch.randint(0, 128, (2, 16))
    loss = lambda out, *_: out  # noqa: E731
    expected = eager_reference(model, (tokens,), loss)
    optimized = remat_pass.optimize(model, budget=0.5)
    assert_same_step(run_step(model, optimized, (tokens,), loss), expected)
    assert len(optimized.pieces) == 1


def _scale_made_in_a_function() -> nn.Module:
    class Scale(nn.Module):  # a class defined in a function, as transformers' rotary embeddings are
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    return Scale()


class _UsesALocalClass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scale = _scale_made_in_a_function()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.linear(x))


def test_a_step_torchs_precompile_cannot_save_says_so():
    """Under TORCH_CACHING_PRECOMPILE Dynamo refuses a step whose guards name a class defined in a
    function (transformers' Llama, Mistral, Qwen and Gemma; plain torch.compile fails the same way):
    the error says it is precompile and to unset it, not to look for graph breaks."""
    with torch._dynamo.config.patch(caching_precompile=True):
        error = _capture_error(_UsesALocalClass(), torch.randn(3, 4))
    message = str(error)
    assert error.diagnosis.cause is CaptureCause.PRECOMPILE, message
    assert "Unset TORCH_CACHING_PRECOMPILE" in message
    assert "graph_breaks" not in message and "fullgraph=False" not in message


def test_hugging_faces_warning_once_in_forward_is_no_graph_break():
    """GPT-2 given labels, as a user builds it from a config: its ``loss_type`` is unset, so its loss
    function calls ``logger.warning_once`` in forward, which dynamo cannot trace; ``optimize`` refused it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1)
    model, tokens = _OwnLoss(GPT2LMHeadModel(config).train()), torch.randint(0, 64, (2, 16))
    model.model.loss_type = None  # unset (transformers 5.25 leaves it so): its loss function warns
    loss = lambda out, *_: out  # noqa: E731
    expected = eager_reference(model, (tokens,), loss)
    optimized = remat_pass.optimize(model, budget=0.5)
    assert_same_step(run_step(model, optimized, (tokens,), loss), expected)
    assert len(optimized.pieces) == 1
