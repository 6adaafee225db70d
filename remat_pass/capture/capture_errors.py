"""Why capture failed, where, and what to do: Dynamo's exception turned into a ``CaptureError``.

Dynamo reports the user's stack under "from user code:", outermost frame first. The first frame
is where the model was entered (for every Hugging Face model a decorator such as
``can_return_tuple`` in ``transformers/utils/generic.py``); the line that broke is the *last*
frame, so that is the one named. The common causes seen on real models each get the step
that fixes them (a table of rules below, one per cause); anything else gets the general advice.
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass
from enum import Enum

from ..errors import CaptureError

__all__ = ["CaptureCause", "capture_failure", "diagnose", "Diagnosis"]

_BACKEND_ADVICE = (
    "torch.compile(model, backend=remat_pass.backend(...)) plans each graph piece between the breaks "
    "separately (the breaking code runs eagerly)"
)


class CaptureCause(str, Enum):
    """The recognized reasons a forward cannot be captured as one graph."""

    LOCK = "lock"
    CHECKPOINT_SIDE_EFFECT = "checkpoint_side_effect"
    HOOK_INSTALL = "hook_install"
    REQUIRES_GRAD_SET = "requires_grad_set"
    RNN = "rnn"
    LAYERDROP = "layerdrop"
    DATA_DEPENDENT = "data_dependent"
    LOGGING = "logging"
    NO_FAKE_IMPL = "no_fake_impl"
    PRECOMPILE = "precompile"
    OTHER = "other"


@dataclass(frozen=True)
class _Rule:
    cause: CaptureCause
    pattern: re.Pattern[str]  # searched in Dynamo's message and the breaking source line
    advice: str


_RULES: tuple[_Rule, ...] = (
    _Rule(
        CaptureCause.CHECKPOINT_SIDE_EFFECT,
        re.compile(r"Unsafe side effect|skip_fwd_side_effects_in_bwd_under_checkpoint"),
        "a checkpointed region's forward changes Python state outside the region (transformers 5.2x's hub "
        "kernel wrapper does, in every attention layer of a model with gradient_checkpointing_enable()), "
        "which Dynamo refuses because eager checkpointing would run it again in backward. remat_pass never "
        "runs Python code again in backward: `optimize` and `plan` trace with "
        "`torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True` where torch has the "
        "flag; with `torch.compile(..., backend=remat_pass.backend(...))` set it yourself before the first "
        "call; a torch without the flag (this error from `optimize`) needs an upgrade.",
    ),
    _Rule(
        CaptureCause.LOCK,
        re.compile(r"context manager.*\block\b|\bR?Lock\b|with [\w.]*lock\w*\s*:", re.IGNORECASE | re.DOTALL),
        "forward enters a threading lock, which Dynamo cannot trace. Hugging Face models take one the first "
        "time they install their output-capturing hooks (e.g. Mixtral with output_router_logits, Wav2Vec2): "
        "warm up with one forward before optimizing, e.g. `with torch.no_grad(): model(**batch)`; the hooks "
        "are then installed and the lock is no longer entered. `optimize` does that warm-up itself once: "
        "from it, this means forward takes the lock on every call; move the lock out of forward, or plan "
        f"the pieces around it: {_BACKEND_ADVICE}.",
    ),
    _Rule(
        CaptureCause.HOOK_INSTALL,
        re.compile(r"RemovableHandle|register_(full_backward_|forward_)(pre_)?hook"),
        "forward registers module hooks, which Dynamo cannot trace. Hugging Face models install their "
        "output-capturing hooks on the first call that asks for extra outputs (Mixtral with "
        "output_router_logits=True): warm up with one forward first, e.g. `with torch.no_grad(): "
        "model(**batch)`. `optimize` does that warm-up itself once: from it, this means forward registers "
        f"hooks on every call; register them once, outside forward, or {_BACKEND_ADVICE}.",
    ),
    _Rule(
        CaptureCause.REQUIRES_GRAD_SET,
        re.compile(r"requires_grad"),
        "forward sets `requires_grad` on a tensor it computed, which AOTAutograd cannot trace. Hugging Face "
        "audio models (Wav2Vec2, HuBERT, WavLM, ...) do this in a trainable feature encoder: call "
        "`model.freeze_feature_encoder()` (the usual fine-tuning setup), or move the assignment out of forward.",
    ),
    _Rule(
        CaptureCause.RNN,
        re.compile(r"\b(RNN|GRU|LSTM)\b|allow_rnn"),
        "nn.RNN/nn.GRU/nn.LSTM are traced only with `torch._dynamo.config.allow_rnn = True` (experimental in "
        f"torch; set it before the first call). Otherwise {_BACKEND_ADVICE}.",
    ),
    _Rule(
        CaptureCause.LAYERDROP,
        re.compile(r"skip_the_layer|layer_?drop", re.IGNORECASE),
        "forward skips layers at random (LayerDrop: a branch on a random tensor), which is not one graph: set "
        "the model's layer-drop probability to 0 (Hugging Face: `model.config.layerdrop = 0.0`), or "
        f"{_BACKEND_ADVICE}. Hugging Face models before transformers 5.23 (OPT among them) draw the "
        "random number even at layerdrop 0: there, upgrade transformers to 5.23 or newer.",
    ),
    _Rule(
        CaptureCause.DATA_DEPENDENT,
        re.compile(r"data[- ]dependent|nonzero|\.item\(\)|dynamic shape operator|unbacked|specialized integer",
                   re.IGNORECASE),
        "forward depends on tensor values (a branch on a tensor, `.nonzero()`/`.item()` deciding a loop, as in "
        f"eager mixture-of-experts routing), so it is not one graph. {_BACKEND_ADVICE}; or make the code "
        "branchless (torch.where), or pick a batched experts implementation where the model offers one "
        "(Hugging Face's Mixtral routes its experts without a data-dependent loop from transformers 5.23).",
    ),
    _Rule(
        CaptureCause.LOGGING,
        re.compile(r"\blog(ger|ging)\b|warning_once|warnings\.warn", re.IGNORECASE),
        "forward logs or warns (`logger.warning(...)`; remat_pass leaves only Hugging Face's `warning_once` "
        "untraced): add the method to `torch._dynamo.config.ignore_logger_methods` (dynamo then drops the call), "
        "or avoid what triggers the message.",
    ),
    _Rule(
        CaptureCause.NO_FAKE_IMPL,
        re.compile(r"fake (impl|kernel|tensor)|register_fake|meta kernel", re.IGNORECASE),
        "a custom op has no fake (meta) implementation, so its output shape is unknown while tracing: register "
        "one with `torch.library.register_fake`.",
    ),
    _Rule(
        CaptureCause.PRECOMPILE,
        re.compile(r"saved into torch\.compile\(\) package|guards_state must not be None|guard cannot be serialized"),
        "torch's precompile (TORCH_CACHING_PRECOMPILE=1, experimental in torch) cannot save this step, and plain "
        "torch.compile fails the same way under it: with torch 2.13 and transformers 5.25, Llama, Mistral, Qwen2, "
        "Qwen3 and Gemma define a class inside a function (their rotary embedding's), and Falcon's step has a "
        "guard torch cannot serialize. Unset TORCH_CACHING_PRECOMPILE: remat_pass's plan cache and torch's "
        "caches still answer a restart's planning and compiles (the step is traced again).",
    ),
)

_GENERAL_ADVICE = (
    "Common causes: data-dependent control flow (`if x.sum() > 0`), calls into code torch.compile cannot "
    f"trace, or Python side effects in forward. Make forward traceable, or use {_BACKEND_ADVICE}."
)


@dataclass(frozen=True)
class Diagnosis:
    """What broke (``reason``), where (``frame``: the user's line), why (``cause``) and what to do."""

    reason: str
    frame: traceback.FrameSummary | None
    cause: CaptureCause
    advice: str

    def location(self) -> str:
        if self.frame is None:
            return ""
        code = f"\n    {self.frame.line.strip()}" if self.frame.line else ""
        return f'File "{self.frame.filename}", line {self.frame.lineno}, in {self.frame.name}{code}'


def user_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The innermost user frame Dynamo recorded: the line that broke, not the entry decorator."""
    stack = getattr(error, "real_stack", None)
    if stack:
        return stack[-1]
    return _last_frame_in_text(str(error))


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)')


def _last_frame_in_text(text: str) -> traceback.FrameSummary | None:
    """Fallback for exceptions without ``real_stack``: the last frame under "from user code:"."""
    _, marker, user_code = text.partition("from user code:")
    if not marker:
        return None
    lines = user_code.splitlines()
    last = None
    for index, line in enumerate(lines):
        match = _FRAME.match(line)
        if match:
            source = lines[index + 1].strip() if index + 1 < len(lines) else None
            last = traceback.FrameSummary(match["file"], int(match["line"]), match["name"], line=source or None)
    return last


def _reason(text: str, fallback: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines()]
    reason = lines[0] if lines and lines[0] else fallback
    # Dynamo's first line is a category ("Unsupported context manager"); its explanation says why.
    explanation = next((line[len("Explanation:"):].strip() for line in lines if line.startswith("Explanation:")), "")
    return f"{reason} ({explanation[:500]})" if explanation else reason


def diagnose(error: BaseException) -> Diagnosis:
    """Classify a capture exception by the first rule whose pattern matches its text or the line."""
    text = str(error)
    frame = user_frame(error)
    searched = "\n".join(part for part in (text.partition("from user code:")[0], frame and frame.line) if part)
    rule = next((rule for rule in _RULES if rule.pattern.search(searched)), None)
    return Diagnosis(
        reason=_reason(text, type(error).__name__),
        frame=frame,
        cause=rule.cause if rule else CaptureCause.OTHER,
        advice=rule.advice if rule else _GENERAL_ADVICE,
    )


def capture_failure(error: BaseException) -> CaptureError:
    """Turn a Dynamo/AOTAutograd exception into an error that names the line and says what to do."""
    diagnosis = diagnose(error)
    where = f"\n  at {diagnosis.location()}" if diagnosis.frame else ""
    breaks = "" if diagnosis.cause is CaptureCause.PRECOMPILE else "\nSet TORCH_LOGS=graph_breaks to see every place tracing stops."
    failure = CaptureError(
        f"could not capture the model as one graph: {type(error).__name__}: {diagnosis.reason}{where}\n"
        f"What to do: {diagnosis.advice}{breaks}"
    )
    failure.diagnosis = diagnosis  # type: ignore[attr-defined]  # for programs that branch on the cause
    return failure
