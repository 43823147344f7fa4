"""Measure a per-layer profile (``dapple.profile``) of a real PyTorch model.

For each batch size, each layer runs forward and backward on its own, on
real tensors: layer i gets layer i-1's real output for that batch (detached,
as a pipeline stage receives it) and its backward gets a random upstream
gradient of its output's shape. The last layer is measured with the loss,
as the last stage runs it: its forward includes the loss on the batch's
real targets, its backward starts from the loss, and what the loss keeps
for backward (the log-probabilities of a cross-entropy: samples x positions
x classes, in the loss's dtype) counts in its stored activations. Times
are medians over ``repeats`` runs after ``warmup`` runs:
``time.perf_counter`` around the call on the CPU, CUDA events on a GPU.
Sizes:

- ``activation_bytes``: the layer's output tensors (what crosses a cut);
- ``stored_activation_bytes``: the tensors autograd saves for backward
  during the layer's forward (seen through
  ``torch.autograd.graph.saved_tensors_hooks``), each storage counted once
  by its data pointer, parameters and buffers left out (they are counted as
  model state);
- ``param_bytes``: the layer's parameters (a parameter shared by two layers
  counts in both).

Imports torch only when called; ``import planner`` stays torch-free.
"""

from __future__ import annotations

import datetime as _dt
import platform
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

from .errors import InvalidInputError
from .profile import Profile

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


def _as_layer_input(x, dev):
    """What a stage receives: the tensors on the device, detached, floating
    ones requiring grad (so backward computes the gradient to send back)."""

    def prep(t):
        t = t.detach().to(dev)
        if t.is_floating_point() or t.is_complex():
            t.requires_grad_(True)
        return t

    return _map(x, prep)


class _Timer:
    def __init__(self, torch, dev):
        self.torch = torch
        self.cuda = dev.type == "cuda"
        self.dev = dev

    def __call__(self, fn) -> tuple[float, Any]:
        """Run ``fn()``; return (milliseconds, its result)."""
        if self.cuda:
            start = self.torch.cuda.Event(enable_timing=True)
            end = self.torch.cuda.Event(enable_timing=True)
            self.torch.cuda.synchronize(self.dev)
            start.record()
            result = fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end), result
        t0 = time.perf_counter()
        result = fn()
        return (time.perf_counter() - t0) * 1000.0, result


def _saved_bytes(torch, layer, x_in, loss=None) -> tuple[int, Any]:
    """Run one forward (and ``loss`` of its output, where given); bytes of
    the tensors autograd saves for backward, each storage once, parameters
    and buffers excluded; and the layer's output."""
    skip = {t.untyped_storage().data_ptr() for t in list(layer.parameters()) + list(layer.buffers())}
    seen: dict[int, int] = {}

    def pack(t):
        try:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr not in skip and ptr not in seen:
                seen[ptr] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage
            seen[id(t)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x_in)
        if loss is not None:
            loss(out)
    return sum(seen.values()), out


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
) -> Profile:
    """Measure ``spec`` layer by layer at each of ``batch_sizes``; return the
    validated :class:`planner.Profile`.

    ``threads``: CPU threads torch may use while measuring (default 1: steady
    times on a shared machine; ``None`` keeps torch's setting). The setting
    is restored afterwards. ``seed`` makes the batches and upstream gradients
    reproducible. The layers are moved to ``device`` and left there, in
    training mode, with their gradients cleared."""
    torch = _torch()
    if not model_name or not model_name.strip():
        raise InvalidInputError("model name must not be blank")
    sizes = sorted(set(batch_sizes))
    if not sizes or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in sizes):
        raise InvalidInputError(f"batch sizes must be positive integers, not {batch_sizes!r}")
    if warmup < 0 or repeats < 1:
        raise InvalidInputError(f"need warmup >= 0 and repeats >= 1 (got {warmup}, {repeats})")
    dev = check_device(device)

    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        spec.to(dev).train(True)
        layers_out = [
            {
                "name": name,
                **({"kind": "block"} if name in spec.blocks else {}),
                "param_bytes": sum(p.numel() * p.element_size() for p in layer.parameters()),
                "measurements": [],
                # How the layer splits, where it declares it (the runtime
                # shards it this way: runtime/tensor_parallel.py).
                **({"split": list(layer.split_patterns)} if getattr(layer, "split_patterns", None) else {}),
            }
            for name, layer in spec.layers
        ]
        device_name = _device_name(torch, dev)
        timer = _Timer(torch, dev)
        with _progress(progress, len(sizes) * len(spec.layers)) as advance:
            for b in sizes:
                gen = torch.Generator().manual_seed(seed + b)
                inputs, targets = spec.make_batch(b, gen)
                targets = _as_layer_input(targets, dev)
                x = inputs
                last = len(spec.layers) - 1
                for k, ((name, layer), record) in enumerate(zip(spec.layers, layers_out)):
                    advance(f"batch {b}: {name}")
                    loss = (lambda out: spec.loss(out, targets)) if k == last else None
                    m, x = _measure_layer(torch, timer, layer, x, dev, gen, warmup, repeats, f"{name} at batch {b}", loss)
                    record["measurements"].append({"batch_size": b, **m})
                for p in spec.parameters():
                    p.grad = None
    finally:
        torch.set_num_threads(old_threads)

    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    data = {
        "model": model_name,
        "source": (
            f"measured by dapple profile on {device_name} {date}: median of {repeats} runs after {warmup} warm-up, "
            f"torch {torch.__version__}"
        ),
        "device": device_name,
        "optimizer": "adam",
        "layers": layers_out,
    }
    return Profile.from_dict(data)


def _measure_layer(torch, timer, layer, x, dev, gen, warmup, repeats, what, loss=None):
    """Forward and backward times and sizes of ``layer`` on ``x``; with
    ``loss``, the layer followed by the loss on its output, the backward
    started from the loss."""
    x_in = _as_layer_input(x, dev)
    stored, out = _saved_bytes(torch, layer, x_in, loss)
    outs = [t for t in _tensors(out) if t.requires_grad]
    if not _tensors(out):
        raise InvalidInputError(f"layer {what}: returned no tensor")
    # One upstream gradient per differentiable output, fixed across repeats;
    # none after a loss (a scalar: its backward starts at 1).
    grads = None if loss is not None else [
        torch.randn(t.shape, generator=gen, dtype=t.dtype).to(dev) for t in outs
    ]

    def forward():
        out_i = layer(x_in)
        return out_i if loss is None else loss(out_i)

    fwd, bwd = [], []
    for i in range(warmup + repeats):
        ms, out_i = timer(forward)
        if outs:
            # The graph just built is the one backward runs through.
            outs_i = [t for t in _tensors(out_i) if t.requires_grad]
            bms, _ = timer(lambda: torch.autograd.backward(outs_i, grads))
        else:
            bms = 0.0
        if i >= warmup:
            fwd.append(ms)
            bwd.append(bms)
        del out_i
    with torch.no_grad():
        next_x = _map(out, lambda t: t.detach())
    return (
        {
            "fwd_ms": round(statistics.median(fwd), 6),
            "bwd_ms": round(statistics.median(bwd), 6),
            "activation_bytes": _nbytes(out),
            "stored_activation_bytes": stored,
        },
        next_x,
    )


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
