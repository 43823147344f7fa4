"""Point-to-point transport between stages: the wire format of activations
and gradients (a shape header, then the data) and the tags that keep
micro-batches and directions apart.

An activation crosses in whatever dtype its stage's forward produced (under
``--dtype bf16`` autocast's bf16, or fp32 after an op autocast keeps in
fp32): the header carries the dtype with the shape. A gradient needs no
header: autograd gives it its activation's dtype and shape, so the sender of
the activation receives it into a buffer made like its output.

Sends are non-blocking (``isend``) and waited for at the end of the
iteration (of the run, for an asynchronous schedule); receives block. Since every rank follows its stage's action list,
which the core's lock-step check proves deadlock-free, every receive is
eventually matched.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

#: Header: [dtype code, ndim, up to 7 dims].
HEADER_LENGTH = 9
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]


#: Where a tensor crosses: (boundary, micro-batch, backward). Boundary b
#: joins stages b and b + 1, whose ranks may be joined by several (a
#: chunked plan's looped chunks).
Crossing = tuple[int, int, bool]


def tag(crossing: Crossing, boundaries: int, part: int) -> int:
    """Distinct per crossing; part 0 is the header, 1 the data."""
    boundary, micro_batch, backward = crossing
    return (micro_batch * max(boundaries, 1) + boundary) * 4 + (2 if backward else 0) + part


class PointToPoint:
    """One rank's sends and receives to other stages' ranks, over
    ``boundaries`` stage boundaries. A tensor this rank sends itself (from
    one of its chunks to the next, the turn of a V) is handed over in
    memory."""

    def __init__(self, device: torch.device, rank: int = -1, boundaries: int = 1):
        self.device = device  # NCCL moves only tensors on the rank's GPU, headers too
        self.rank, self.boundaries = rank, boundaries
        self.pending: list[tuple[Any, torch.Tensor]] = []
        self.kept: dict[Crossing, torch.Tensor] = {}  # sent to this rank itself
        self.recv_s = 0.0  # time spent blocked in receives
        #: On CUDA, the executor's ``timing.EventTimer`` of a step's compute:
        #: each receive's wait on the stream is taken out of its pass.
        self.gpu_timer = None

    def _recv(self, t: torch.Tensor, src: int, tag_: int) -> None:
        t0 = time.perf_counter()
        gpu = self.gpu_timer.start() if self.gpu_timer is not None else None
        dist.recv(t, src, tag=tag_)
        if gpu is not None:
            self.gpu_timer.stop(gpu, sign=-1)
        self.recv_s += time.perf_counter() - t0

    def send(self, t: torch.Tensor, dst: int, crossing: Crossing, header: bool) -> None:
        t = t.detach().contiguous()
        if dst == self.rank:
            self.kept[crossing] = t.clone()
            return
        if header:
            if t.dim() > HEADER_LENGTH - 2:
                raise ValueError(f"tensors of {t.dim()} dimensions cannot cross a stage")
            h = torch.tensor([DTYPES.index(t.dtype), t.dim(), *t.shape] + [0] * (HEADER_LENGTH - 2 - t.dim()),
                             dtype=torch.int64, device=self.device)
            self.pending.append((dist.isend(h, dst, tag=tag(crossing, self.boundaries, 0)), h))
        self.pending.append((dist.isend(t, dst, tag=tag(crossing, self.boundaries, 1)), t))

    def recv_with_header(self, src: int, crossing: Crossing) -> torch.Tensor:
        if src == self.rank:
            return self.kept.pop(crossing)
        h = torch.zeros(HEADER_LENGTH, dtype=torch.int64, device=self.device)
        self._recv(h, src, tag(crossing, self.boundaries, 0))
        header = h.tolist()
        shape = header[2 : 2 + header[1]]
        t = torch.empty(shape, dtype=DTYPES[header[0]], device=self.device)
        self._recv(t, src, tag(crossing, self.boundaries, 1))
        return t

    def recv_into(self, t: torch.Tensor, src: int, crossing: Crossing) -> None:
        if src == self.rank:
            t.copy_(self.kept.pop(crossing))
            return
        self._recv(t, src, tag(crossing, self.boundaries, 1))

    def reap(self) -> None:
        """Forget the sends that have completed (a long asynchronous run
        waits for its sends only at the end)."""
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]

    def wait_all(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


class StageLinks:
    """The sends and receives of one replica to its neighbouring stages,
    written once for every schedule: which samples of a micro-batch go to,
    and come from, which rank (the core's layout), over ``comm``.

    ``prev`` and ``nxt``: ``(rank, (start, end))`` of each peer of the
    previous and the next stage the input comes from and the output goes
    to; ``lo``: the first sample of this replica's slice, so a peer's
    samples ``[start, end)`` are rows ``start - lo .. end - lo`` of this
    replica's tensors. ``grads_to`` and ``grads_from``: the peers the
    input's gradient goes to and the output's comes from, where they differ
    (a split stage's shards all get the same input, but each sender needs
    its output's gradient once); by default ``prev`` and ``nxt``."""

    def __init__(self, comm: PointToPoint, prev: list[tuple[int, tuple[int, int]]],
                 nxt: list[tuple[int, tuple[int, int]]], lo: int,
                 grads_to: list[tuple[int, tuple[int, int]]] | None = None,
                 grads_from: list[tuple[int, tuple[int, int]]] | None = None, stage: int = 0):
        self.comm = comm
        self.stage = stage  # its input crosses boundary stage - 1, its output boundary stage
        self.prev = prev
        self.nxt = nxt
        self.lo = lo
        self.grads_to = prev if grads_to is None else grads_to
        self.grads_from = nxt if grads_from is None else grads_from

    def receive_input(self, micro_batch: int) -> torch.Tensor:
        """This replica's input of ``micro_batch``: the previous stage's
        outputs, joined along dim 0."""
        parts = [self.comm.recv_with_header(src, (self.stage - 1, micro_batch, False)) for src, _ in self.prev]
        return torch.cat(parts, 0) if len(parts) > 1 else parts[0]

    def send_output(self, out: torch.Tensor, micro_batch: int) -> None:
        for dst, (s0, s1) in self.nxt:
            self.comm.send(out[s0 - self.lo : s1 - self.lo], dst, (self.stage, micro_batch, False), header=True)

    def receive_output_grad(self, out: torch.Tensor, micro_batch: int) -> torch.Tensor:
        """The gradient of ``out`` (this replica's output of ``micro_batch``),
        gathered from the next stage's ranks."""
        grad = torch.empty_like(out)
        for src, (s0, s1) in self.grads_from:
            piece = torch.empty_like(out[s0 - self.lo : s1 - self.lo])
            self.comm.recv_into(piece, src, (self.stage, micro_batch, True))
            grad[s0 - self.lo : s1 - self.lo] = piece
        return grad

    def send_input_grad(self, grad: torch.Tensor, micro_batch: int) -> None:
        for dst, (s0, s1) in self.grads_to:
            self.comm.send(grad[s0 - self.lo : s1 - self.lo], dst, (self.stage - 1, micro_batch, True), header=False)
