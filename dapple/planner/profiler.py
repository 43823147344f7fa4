"""Measure a per-layer profile (``dapple.profile``) of a real PyTorch model.

At each batch size the model runs whole forward and backward passes, its
layers chained as in training, the last layer followed by the loss on the
batch's real targets (as the last stage runs it). Times come from stamps
between layers inside each pass, with no synchronisation until the pass
ends: ``time.perf_counter`` on the CPU; CUDA events recorded on the stream
on a GPU, so each layer's time is the GPU's while the host runs ahead, as
in training. (Timing each layer on its own, with a synchronisation around
it, adds the launch latency of every call: a floor of about 1 ms forward
and 1.8 ms backward per GPT block on an H100, docs/fidelity.md.) A
backward's boundaries are hooks on each layer's outputs: the gradient of
layer k's output is complete when layer k's backward begins. A layer's
time is the median over ``repeats`` passes after ``warmup`` passes, less
what the stamps and hooks themselves cost: every layer's time is scaled by
the median whole pass without them over the median sum with them (at
most 1).

More passes time what training may run instead of a layer's backward:
``recompute_fwd_ms``, the forward a re-computed stage re-runs (each layer's
backward under its own checkpoint, over its plain one), and
``bwd_weight_ms``, the weight gradient of a backward split as zero-bubble
schedules split it (the backward over its input gradient, which
``torch.autograd.grad`` to the layers' outputs alone computes).

Sizes, from one more pass per batch size:

- ``activation_bytes``: the layer's output tensors (what crosses a cut; the
  last layer's own output, not the loss);
- ``stored_activation_bytes``: the tensors autograd saves for backward
  during the layer's forward (seen through
  ``torch.autograd.graph.saved_tensors_hooks``), each storage counted once
  per layer by its data pointer, parameters and buffers left out (model
  state), and autocast's copies of the weights apart; on the last layer
  this includes what the loss keeps (a cross-entropy's log-probabilities);
- ``backward_working_bytes``: what the layer's backward allocates above
  what was held when it began, at its peak (torch's ``MemTracker``:
  gradients of activations, temporaries; on the last layer the loss's
  gradient of the logits), parameter gradients left out;
- ``weight_copy_bytes`` (per layer, mixed precision only): autocast's
  copies of the weights that each micro-batch keeps until its backward;
- ``param_bytes``: the layer's parameters (a parameter shared by two layers
  counts in both);
- ``allocator_reserved_factor`` (CUDA only): what torch's caching
  allocator reserved at its peak over what it allocated at its peak.

After each timed pass the profile's optimizer (torch's Adam, at learning
rate 0 so the weights stay) steps on the pass's gradients, as training
does: ``optimizer_step_ms`` is the median step over every parameter, and
``optimizer_step_bytes`` what one step allocates above what was held before
it, at its peak (torch's ``MemTracker``, on one step that is not timed).

With ``dtype`` bf16 or fp16 the passes run under ``torch.autocast``, as
``dapple run --dtype`` trains; the profile records the dtype and the bytes
per parameter of each state (the core's rule for autocast).

On the CPU the process keeps freed memory in its heap from then on
(``runtime.memory.keep_freed_memory``), as ``dapple run`` does on the CPU:
glibc's default makes a step's time depend on whether its tensors come back
as fresh pages.

Imports torch only when called; ``from dapple import planner`` stays torch-free.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import platform
import statistics
import sys
import time
from typing import TYPE_CHECKING

from .errors import InvalidInputError
from .precision import autocast_parameter_state, check_precision, torch_dtype
from .profile import Profile
from .runtime.memory import keep_freed_memory

if TYPE_CHECKING:  # pragma: no cover
    from .runtime.models import ModelSpec

__all__ = ["profile_model", "check_device"]


def _torch():
    try:
        import torch
    except ImportError as e:
        raise InvalidInputError(
            f"profiling a model needs torch, which is not installed ({e}); install it with pip install 'dapple[torch]'"
        ) from None
    return torch


def check_device(device: str):
    """The ``torch.device`` for ``device`` (``cpu``, ``cuda``, ``cuda:N``), or
    InvalidInputError when it is unknown or not available."""
    torch = _torch()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidInputError(f"--device {device}: not a device ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise InvalidInputError(f"--device {device}: CUDA is not available ({why}, torch {torch.__version__})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InvalidInputError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif dev.type != "cpu":
        raise InvalidInputError(f"--device {device}: only cpu and cuda are supported")
    return dev


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def _device_name(torch, dev) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"CPU {cpu_name()} ({torch.get_num_threads()} thread{'s' if torch.get_num_threads() != 1 else ''})"


def _tensors(x) -> list:
    """The tensors in a layer's input or output (a tensor, or nested tuples/lists/dicts)."""
    import torch

    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in _tensors(item)]
    return []


def _map(x, fn):
    import torch

    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, tuple):
        return tuple(_map(item, fn) for item in x)
    if isinstance(x, list):
        return [_map(item, fn) for item in x]
    if isinstance(x, dict):
        return {k: _map(v, fn) for k, v in x.items()}
    return x


def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(x))


def profile_model(
    spec: "ModelSpec",
    model_name: str,
    batch_sizes: list[int],
    device: str = "cpu",
    warmup: int = 2,
    repeats: int = 5,
    progress: bool = True,
    *,
    threads: int | None = 1,
    seed: int = 0,
    dtype: str = "fp32",
) -> Profile:
    """Measure ``spec`` layer by layer at each of ``batch_sizes``; return the
    validated :class:`planner.Profile`.

    ``dtype``: ``fp32``, or ``bf16``/``fp16`` for mixed precision as
    ``dapple run --dtype`` trains (torch's autocast; weights, gradients and
    optimizer state stay fp32). ``threads``: CPU threads torch may use while
    measuring (default 1: steady times on a shared machine; ``None`` keeps
    torch's setting). The setting is restored afterwards. ``seed`` makes the
    batches reproducible. The layers are moved to ``device`` and left there,
    in training mode, with their gradients cleared. On the CPU the process
    keeps freed memory in its heap afterwards (the module's note)."""
    torch = _torch()
    if not model_name or not model_name.strip():
        raise InvalidInputError("model name must not be blank")
    sizes = sorted(set(batch_sizes))
    if not sizes or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in sizes):
        raise InvalidInputError(f"batch sizes must be positive integers, not {batch_sizes!r}")
    if warmup < 0 or repeats < 1:
        raise InvalidInputError(f"need warmup >= 0 and repeats >= 1 (got {warmup}, {repeats})")
    check_precision(dtype)
    state = autocast_parameter_state("adam")
    dev = check_device(device)
    if dev.type == "cpu":
        keep_freed_memory()

    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        spec.to(dev).train(True)
        measured: list[list[dict]] = [[] for _ in spec.layers]
        device_name = _device_name(torch, dev)
        # The profile's optimizer, as `dapple run --optimizer adam` makes it,
        # stepped after each timed pass as training steps it; at learning
        # rate 0, so the weights stay as they are.
        stepper = _Stepper(torch, torch.optim.Adam([p for p in spec.parameters() if p.requires_grad], lr=0.0))
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        with _progress(progress, len(sizes) * (4 + warmup + 4 * repeats)) as advance:
            for b in sizes:
                gen = torch.Generator().manual_seed(seed + b)
                options = (warmup, repeats, dtype, advance, stepper)
                for record, m in zip(measured, _measure_batch(torch, spec, dev, b, gen, options)):
                    record.append(m)
                for p in spec.parameters():
                    p.grad = None
            while not stepper.times_ms:  # every step so far made the state, or measured its memory
                stepper.step(_Clock(torch, dev), keep=True)
        reserve = _allocator_reserved_factor(torch, dev)
    finally:
        torch.set_num_threads(old_threads)

    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    data = {
        "model": model_name,
        "source": (
            f"measured by dapple profile on {device_name} {date}: {dtype}, layers timed inside whole passes, "
            f"median of {repeats} passes after {warmup} warm-up, torch {torch.__version__}"
        ),
        "device": device_name,
        "optimizer": "adam",
        "dtype": dtype,
        "parameter_state": state,
        "optimizer_step_ms": round(statistics.median(stepper.times_ms), 6),
        "optimizer_step_bytes": stepper.step_bytes,
        **({"allocator_reserved_factor": reserve} if reserve else {}),
        "layers": [_layer_record(name, layer, spec, records) for (name, layer), records in zip(spec.layers, measured)],
    }
    return Profile.from_dict(data)


def _allocator_reserved_factor(torch, dev) -> float | None:
    """On CUDA, what torch's caching allocator reserved at its peak over
    what it allocated at its peak, over the whole profiling (the largest
    batch's passes set both); None on the CPU, whose allocator returns
    memory to the system."""
    if dev.type != "cuda":
        return None
    allocated = torch.cuda.max_memory_allocated(dev)
    if allocated <= 0:
        return None
    return round(max(1.0, torch.cuda.max_memory_reserved(dev) / allocated), 4)


class _Stepper:
    """An optimizer stepped after each timed pass, on the gradients the pass
    left (the caches as training leaves them), and its step times; the
    first step, which makes the optimizer's state, is not kept."""

    def __init__(self, torch, optimizer):
        self.optimizer = optimizer
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.torch = torch
        self.times_ms: list[float] = []
        #: What one step allocates above what was held when it began, at its
        #: peak; measured on the first step that finds the state made.
        self.step_bytes: int | None = None

    def step(self, clock, keep: bool) -> None:
        for p in self.params:
            if p.grad is None:  # a parameter the pass did not reach
                p.grad = self.torch.zeros_like(p)
        fresh = not self.optimizer.state
        if not fresh and self.step_bytes is None:
            self.step_bytes = self._measured_step_bytes()  # not timed: the tracker slows it
        else:
            start = clock.stamp()
            self.optimizer.step()
            end = clock.stamp()
            clock.finish(end)
            if keep and not fresh:
                self.times_ms.append(clock.ms(start, end))
        for p in self.params:
            p.grad = None

    def _measured_step_bytes(self) -> int:
        """One step under torch's MemTracker: its peak over what was held
        before it (torch's foreach Adam holds about one more copy of the
        weights; the loop over parameters, the CPU's default, the largest
        parameter's)."""
        from torch.distributed._tools.mem_tracker import MemTracker

        def total(snapshot) -> int:
            return sum(device["Total"] for device in snapshot.values())

        tracker = MemTracker()
        tracker.track_external(self.optimizer, *self.params)
        with tracker:
            before = total(tracker.get_tracker_snapshot("current"))
            self.optimizer.step()
            peak = total(tracker.get_tracker_snapshot("peak"))
        return max(0, peak - before)


def _layer_record(name, layer, spec, records: list[dict]) -> dict:
    """A profile layer from its measurements: autocast's weight copies are
    the same at every batch size (the largest's are kept)."""
    copies = records[-1]["weight_copy_bytes"]
    return {
        "name": name,
        **({"kind": "block"} if name in spec.blocks else {}),
        "param_bytes": sum(p.numel() * p.element_size() for p in layer.parameters()),
        **({"weight_copy_bytes": copies} if copies else {}),
        "measurements": [{k: v for k, v in m.items() if k != "weight_copy_bytes"} for m in records],
        # How the layer splits, where it declares it (the runtime
        # shards it this way: runtime/tensor_parallel.py).
        **({"split": list(layer.split_patterns)} if getattr(layer, "split_patterns", None) else {}),
        # Its routed experts, where it has them (the runtime spreads them
        # over a stage's expert groups: runtime/experts.py).
        **({"experts": dict(layer.expert_pattern)} if getattr(layer, "expert_pattern", None) else {}),
    }


class _Clock:
    """Time stamps inside a pass: ``time.perf_counter`` on the CPU; CUDA
    events on a GPU, recorded on the stream without waiting and read after
    one synchronisation at the pass's end (so a layer's time is the GPU's,
    with the next layer's kernels already queued behind it, as in training)."""

    def __init__(self, torch, dev):
        self.torch = torch
        self.cuda = dev.type == "cuda"

    def stamp(self):
        if self.cuda:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def finish(self, last) -> None:
        if self.cuda:
            last.synchronize()

    def ms(self, a, b) -> float:
        if self.cuda:
            return a.elapsed_time(b)
        return (b - a) * 1000.0


def _precision_context(torch, dev, dtype: str):
    """Autocast to ``dtype`` on ``dev``'s type (parameters stay fp32), or nothing for fp32."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(dev.type, dtype=torch_dtype(torch, dtype))


def _with_loss(torch, layer, loss, targets):
    """The last layer followed by the loss on the batch's targets, as the
    last stage runs it; it notes the bytes of the layer's own output (the
    logits), what a cut after it would carry."""

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer
            self.output_bytes = 0
            #: Called between the layer and the loss (``_Saved.enter_loss``).
            self.on_loss = None

        def forward(self, x):
            out = self.layer(x)
            self.output_bytes = _nbytes(out)
            if self.on_loss is not None:
                self.on_loss()
            return loss(out, targets)

    return WithLoss()


def _checkpointed(torch, layer):
    """``layer`` under torch's non-reentrant checkpoint, as ``dapple run
    --recompute`` runs a stage: its backward re-runs the forward, as far as
    the saved tensors it needs."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            return checkpoint(self.layer, x, use_reentrant=False)

    return Checkpointed()


def _is_weight_copy(t, params: set[int]) -> bool:
    """Whether ``t`` is (a view of) one of ``params`` cast to another dtype:
    autocast's copy, which the layer's backward keeps."""
    fn = t.grad_fn
    for _ in range(4):  # through a transpose, view or expand
        if fn is None:
            return False
        if fn.name() == "ToCopyBackward0":
            source = fn.next_functions[0][0]
            return type(source).__name__ == "AccumulateGrad" and id(source.variable) in params
        if len(fn.next_functions) != 1:
            return False
        fn = fn.next_functions[0][0]
    return False


class _Saved:
    """What autograd saves during one layer's forward, seen through
    ``saved_tensors_hooks``: each storage once, the layer's parameters and
    buffers left out (model state), autocast's copies of its weights apart
    from the activations (they do not grow with the batch)."""

    def __init__(self, layer):
        tensors = list(layer.parameters()) + list(layer.buffers())
        self.skip = {t.untyped_storage().data_ptr() for t in tensors}
        self.params = {id(p) for p in layer.parameters()}
        self.activations: dict[int, int] = {}
        self.weight_copies: dict[int, int] = {}
        #: What the loss after the last layer keeps (kept apart: under
        #: re-computation it stays outside the checkpoint).
        self.loss: dict[int, int] = {}
        self.in_loss = False

    def enter_loss(self) -> None:
        self.in_loss = True

    def pack(self, t):
        try:
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage
            ptr, nbytes = id(t), t.numel() * t.element_size()
        seen = ptr in self.activations or ptr in self.weight_copies or ptr in self.loss
        if ptr and ptr not in self.skip and not seen:
            if _is_weight_copy(t, self.params):
                self.weight_copies[ptr] = nbytes
            else:
                (self.loss if self.in_loss else self.activations)[ptr] = nbytes
        return t


def _sizes_pass(torch, layers, inputs, cast) -> list[dict]:
    """One forward and backward of the whole model: per layer its output
    bytes, what autograd saves for its backward (activations and weight
    copies), and what its backward needs above what it held when it began
    (gradients of activations, temporaries: the peak seen by torch's
    ``MemTracker``, parameter gradients left out as model state)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*layers)
    sizes = []
    with tracker:
        x = inputs
        for layer in layers:
            saved = _Saved(layer)
            if hasattr(layer, "on_loss"):
                layer.on_loss = saved.enter_loss
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), cast():
                out = layer(x)
            sizes.append({"activation_bytes": _nbytes(out), "saved": saved})
            x = out
        x.backward()

    def held(snapshot):
        return sum(dev["Total"] - dev["Gradient"] for dev in snapshot.values())

    for layer, size in zip(layers, sizes):
        snapshots = tracker.memory_tracking[layer].snapshots
        # Keyed by MemTracker's states, a str enum: "Pre-Backward" is _ModState.PRE_BW.
        if "Pre-Backward" in snapshots:  # else the layer has no backward
            before, peak = snapshots["Pre-Backward"][-1], snapshots["Peak-Backward"][-1]
            size["backward_working_bytes"] = max(0, held(peak) - held(before))
        else:
            size["backward_working_bytes"] = 0
    sizes[-1]["activation_bytes"] = layers[-1].output_bytes
    return sizes


def _timed_pass(torch, clock, layers, inputs, cast, input_gradients_only: bool = False
                ) -> tuple[list[float], list[float]]:
    """One forward and backward of the whole model, the last layer ending in
    the loss: each layer's forward and backward milliseconds, from stamps
    between layers, with no synchronisation inside the pass.

    A backward's boundaries are the hooks on each layer's outputs: the
    gradient of layer k's output is complete when layer k+1's backward ends
    and layer k's begins (the layers form a chain, so autograd runs them in
    order). A layer with no output that needs a gradient has nothing to do
    in the backward.

    ``input_gradients_only``: the backward is ``torch.autograd.grad`` to the
    layers' outputs alone, which leaves out every weight gradient: each
    layer's input gradient (I of a zero-bubble split). The first layer's
    input is data, so its I is nothing."""
    n = len(layers)
    marks = [clock.stamp()]
    x, outputs = inputs, []
    for layer in layers:
        with cast():
            x = layer(x)
        marks.append(clock.stamp())
        outputs.append(x)
    arrived: list[list] = [[] for _ in range(n)]
    handles = [
        t.register_hook(lambda grad, k=k: arrived[k].append(clock.stamp()))
        for k in range(n - 1)
        for t in _tensors(outputs[k])
        if t.requires_grad
    ]
    start = clock.stamp()
    try:
        if not input_gradients_only:
            x.backward()
        elif targets := [t for k in range(n - 1) for t in _tensors(outputs[k]) if t.requires_grad]:
            torch.autograd.grad(x, targets)
    finally:
        for h in handles:
            h.remove()
    end = clock.stamp()
    clock.finish(end)
    fwd = [clock.ms(marks[k], marks[k + 1]) for k in range(n)]
    # boundary[k]: when layer k's backward began (ms after the backward's start).
    boundary = [max((clock.ms(start, s) for s in arrived[k]), default=None) for k in range(n)]
    boundary[n - 1] = 0.0
    total = clock.ms(start, end)
    bwd = []
    for k in range(n):
        began = total if boundary[k] is None else boundary[k]
        ended = total if k == 0 or boundary[k - 1] is None else boundary[k - 1]
        bwd.append(max(0.0, ended - began))
    if input_gradients_only:
        # The backward stops at the first layer's output: what follows its
        # arrival is the engine returning, not the layer's work.
        bwd[0] = 0.0
    return fwd, bwd


def _measure_batch(torch, spec, dev, b, gen, options) -> list[dict]:
    """Every layer's measurement at batch size ``b``: sizes from one pass,
    times as the median over ``repeats`` whole passes after ``warmup``."""
    warmup, repeats, dtype, advance, stepper = options
    inputs, targets = spec.make_batch(b, gen)
    inputs = _map(inputs, lambda t: t.to(dev))
    targets = _map(targets, lambda t: t.to(dev))
    modules = [layer for _, layer in spec.layers]
    layers = modules[:-1] + [_with_loss(torch, modules[-1], spec.loss, targets)]

    def cast():
        return _precision_context(torch, dev, dtype)

    advance(f"batch {b}: sizes")
    sizes = _sizes_pass(torch, layers, inputs, cast)
    layers[-1].on_loss = None
    clock = _Clock(torch, dev)
    fwd: list[list[float]] = [[] for _ in layers]
    bwd: list[list[float]] = [[] for _ in layers]
    for i in range(warmup + repeats):
        advance(f"batch {b}: pass {i + 1} of {warmup + repeats}")
        f, bk = _timed_pass(torch, clock, layers, inputs, cast)
        if i >= warmup:
            for k in range(len(layers)):
                fwd[k].append(f[k])
                bwd[k].append(bk[k])
        stepper.step(clock, keep=i >= warmup)
    rerun = _rerun_ms(torch, clock, spec, (b, modules, targets, inputs), cast, repeats, advance)
    input_grad = _input_gradient_ms(torch, clock, b, layers, inputs, cast, repeats, advance)
    # What the stamps and hooks themselves cost, taken out of every layer's
    # time in proportion: the whole pass without them over the sum with.
    plain = _plain_passes_ms(torch, clock, b, (layers, inputs, cast, spec.parameters), repeats, advance)
    instrumented = [sum(f[i] for f in fwd) + sum(bk[i] for bk in bwd) for i in range(repeats)]
    unstamped = min(1.0, statistics.median(plain) / statistics.median(instrumented))
    return [
        {
            "batch_size": b,
            "fwd_ms": round(unstamped * statistics.median(fwd[k]), 6),
            "bwd_ms": round(unstamped * statistics.median(bwd[k]), 6),
            "activation_bytes": size["activation_bytes"],
            "stored_activation_bytes": sum(size["saved"].activations.values()) + sum(size["saved"].loss.values()),
            "backward_working_bytes": size["backward_working_bytes"],
            # The forward re-run when the layer ends a checkpointed stage:
            # its checkpointed backward over its plain one. It may exceed the
            # forward by the checkpoint's own work (saving and restoring the
            # random state, its hooks), once per stage as in the run.
            "recompute_fwd_ms": round(unstamped * max(0.0, statistics.median(rerun[k]) - statistics.median(bwd[k])), 6),
            **({"loss_stored_bytes": sum(size["saved"].loss.values())} if size["saved"].loss else {}),
            # The weight gradient of a split backward: what the backward
            # does beyond its input gradient (torch's zero-bubble stages
            # compute W from the gradients the I pass leaves).
            "bwd_weight_ms": _weight_gradient_ms(unstamped, statistics.median(bwd[k]), statistics.median(input_grad[k])),
            "weight_copy_bytes": sum(size["saved"].weight_copies.values()),
        }
        for k, size in enumerate(sizes)
    ]


def _weight_gradient_ms(unstamped: float, backward_ms: float, input_gradient_ms: float) -> float:
    """The backward beyond its input gradient, both stamped alike (so the
    stamps' cost cancels), scaled as the backward is, within it."""
    return round(unstamped * min(backward_ms, max(0.0, backward_ms - input_gradient_ms)), 6)


def _plain_passes_ms(torch, clock, b, model, repeats: int, advance) -> list[float]:
    """The whole forward, loss and backward without stamps or hooks, as a
    single-stage run computes it, in ``repeats`` passes after one."""
    layers, inputs, cast, parameters = model
    times = []
    for i in range(1 + repeats):
        advance(f"batch {b}: plain pass {i + 1} of {1 + repeats}")
        start = clock.stamp()
        x = inputs
        for layer in layers:
            with cast():
                x = layer(x)
        x.backward()
        end = clock.stamp()
        clock.finish(end)
        if i >= 1:
            times.append(clock.ms(start, end))
        for p in parameters():
            p.grad = None
    return times


def _input_gradient_ms(torch, clock, b, layers, inputs, cast, repeats: int, advance) -> list[list[float]]:
    """Each layer's input gradient at batch size ``b``, in ``repeats``
    passes after one."""
    times: list[list[float]] = [[] for _ in layers]
    for i in range(1 + repeats):
        advance(f"batch {b}: input-gradient pass {i + 1} of {1 + repeats}")
        _, input_grad = _timed_pass(torch, clock, layers, inputs, cast, input_gradients_only=True)
        if i >= 1:
            for k, ms in enumerate(input_grad):
                times[k].append(ms)
    return times


def _rerun_ms(torch, clock, spec, batch, cast, repeats: int, advance) -> list[list[float]]:
    """Each layer's backward when it runs under its own checkpoint (the
    loss outside, as ``dapple run --recompute`` runs it), in ``repeats``
    passes after one: the plain backward plus what the checkpoint re-runs
    of the forward when the layer ends a re-computed stage."""
    b, modules, targets, inputs = batch
    layers = [_checkpointed(torch, m) for m in modules[:-1]]
    layers.append(_with_loss(torch, _checkpointed(torch, modules[-1]), spec.loss, targets))
    times: list[list[float]] = [[] for _ in layers]
    for i in range(1 + repeats):
        advance(f"batch {b}: re-computed pass {i + 1} of {1 + repeats}")
        _, bwd = _timed_pass(torch, clock, layers, inputs, cast)
        if i >= 1:
            for k, ms in enumerate(bwd):
                times[k].append(ms)
        for p in spec.parameters():
            p.grad = None
    return times


class _progress:
    """A rich progress bar on stderr, or nothing."""

    def __init__(self, enabled: bool, total: int):
        self.enabled = enabled
        self.total = total
        self.bar = None

    def __enter__(self):
        if not self.enabled:
            return lambda description: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(
            TextColumn("profiling {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(file=sys.stderr),
            transient=True,
        )
        self.bar.__enter__()
        task = self.bar.add_task("", total=self.total)
        started = [False]

        def advance(description: str):
            if started[0]:
                self.bar.advance(task)
            started[0] = True
            self.bar.update(task, description=description)

        self.task = task
        return advance

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.update(self.task, completed=self.total)
            self.bar.__exit__(*exc)
        return False
