"""Small PyTorch models, split into layers, that need no downloads.

A model is a :class:`ModelSpec`: named layers in execution order (layer 0
takes the input batch, layer i takes layer i-1's output), a loss, and a batch
maker. The profiler (:mod:`planner.profiler`) times each layer; a pipeline
runtime cuts the list into stages.

On the command line a model is named ``package.module:function``, e.g.
``dapple.planner.runtime.models:gpt``; :func:`load_model` imports it. Any function
returning a :class:`ModelSpec` works.

Factories build their weights from a fixed ``seed`` without touching the
global random state, and use no dropout, so two builds are identical and runs
are deterministic.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from .. import _core
from ..errors import InvalidInputError
from .context_parallel import ContextGroup, self_attention, token_positions
from .experts import MoEBlock
from .tensor_parallel import ShardedBlock, ShardedEmbedding, ShardedLMHead, SplitGroup

__all__ = ["ModelSpec", "load_model", "gpt", "gpt_moe", "bert", "vgg", "hf_gpt2", "digits", "TransformerBlock"]


@dataclass
class ModelSpec:
    """A model split into layers.

    ``layers``: ``(name, module)`` pairs in execution order; the first module
    takes the inputs of :attr:`make_batch`, each next one the previous one's
    output. ``loss(output, targets)`` gives a scalar, the mean over the batch.
    ``make_batch(batch_size, generator)`` gives ``(inputs, targets)`` on the
    CPU, reproducible from the ``torch.Generator``.
    ``blocks``: names of the model's own repeated layers (profile kind
    ``"block"``). ``name``: the model name a profile records by default.
    ``model``: optionally the whole model as one module, whose forward equals
    running the layers one after another (used by tests).

    A model trained on a data set declares it: ``validation()`` gives the
    held-out split ``(inputs, targets)``, ``train_size`` the samples of the
    training split (``make_batch`` draws from it; an epoch is
    ``train_size / batch`` steps), and ``classifies`` whether the output's
    argmax is a class to score accuracy with."""

    layers: list[tuple[str, nn.Module]]
    loss: Callable[[Any, Any], torch.Tensor]
    make_batch: Callable[[int, torch.Generator], tuple[Any, Any]]
    blocks: frozenset[str] = frozenset()
    name: str = ""
    model: nn.Module | None = None
    config: dict = field(default_factory=dict)
    validation: Callable[[], tuple[Any, Any]] | None = None
    train_size: int | None = None
    classifies: bool = False

    @property
    def layer_names(self) -> list[str]:
        return [name for name, _ in self.layers]

    def forward(self, inputs):
        """Run all layers in order."""
        x = inputs
        for _, layer in self.layers:
            x = layer(x)
        return x

    def parameters(self):
        """Parameters of all layers, each once."""
        seen: set[int] = set()
        for _, layer in self.layers:
            for p in layer.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def to(self, device) -> "ModelSpec":
        for _, layer in self.layers:
            layer.to(device)
        return self

    def train(self, mode: bool = True) -> "ModelSpec":
        for _, layer in self.layers:
            layer.train(mode)
        return self


# ----------------------------------------------------------------- loading


def load_model(spec: str, **kwargs) -> ModelSpec:
    """Import ``package.module:function`` and call it with ``kwargs``.

    Raises :class:`planner.InvalidInputError` naming ``spec`` when it is
    malformed, the module or function is missing, the call fails, or the
    result is not a :class:`ModelSpec`. The working directory is searched
    too (after installed packages), so local model files work from the
    ``dapple`` command."""
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name.strip() or not func_name.strip() or ":" in func_name:
        raise InvalidInputError(f"--model {spec}: expected package.module:function, e.g. dapple.planner.runtime.models:gpt")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise InvalidInputError(f"--model {spec}: no module named {missing}") from None
        raise InvalidInputError(f"--model {spec}: importing {module_name} failed: {e}") from None
    except Exception as e:  # noqa: BLE001 - user code
        raise InvalidInputError(f"--model {spec}: importing {module_name} failed: {type(e).__name__}: {e}") from None
    func = getattr(module, func_name, None)
    if func is None:
        raise InvalidInputError(f"--model {spec}: module {module_name} has no function {func_name}")
    if not callable(func):
        raise InvalidInputError(f"--model {spec}: {func_name} in {module_name} is not a function")
    try:
        inspect.signature(func).bind(**kwargs)
    except TypeError as e:
        raise InvalidInputError(f"--model {spec}: bad model arguments {kwargs}: {e}") from None
    except ValueError:  # no signature (builtins): let the call decide
        pass
    try:
        result = func(**kwargs)
    except InvalidInputError as e:
        raise InvalidInputError(f"--model {spec}: {e}") from None
    except Exception as e:  # noqa: BLE001 - user code
        raise InvalidInputError(f"--model {spec}: building the model failed: {type(e).__name__}: {e}") from None
    if not isinstance(result, ModelSpec):
        raise InvalidInputError(
            f"--model {spec}: returned {type(result).__name__}, not a dapple.planner.runtime.models.ModelSpec"
        )
    _check(result, spec)
    if not result.name:
        result.name = func_name
    return result


def _check(model: ModelSpec, spec: str) -> None:
    if not model.layers:
        raise InvalidInputError(f"--model {spec}: the model has no layers")
    names = []
    for i, item in enumerate(model.layers):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], nn.Module)):
            raise InvalidInputError(f"--model {spec}: layers[{i}] is not a (name, torch.nn.Module) pair")
        if not item[0].strip():
            raise InvalidInputError(f"--model {spec}: layers[{i}] has a blank name")
        names.append(item[0])
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise InvalidInputError(f"--model {spec}: layer names repeat: {', '.join(dup)}")
    unknown = sorted(set(model.blocks) - set(names))
    if unknown:
        raise InvalidInputError(f"--model {spec}: blocks name no layer: {', '.join(unknown)}")


# ---------------------------------------------------------------- building


class _seeded:
    """Build modules from ``seed`` without changing the global random state."""

    def __init__(self, seed: int):
        self.seed = seed

    def __enter__(self):
        self._fork = torch.random.fork_rng(devices=[])
        self._fork.__enter__()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc):
        return self._fork.__exit__(*exc)


class TransformerBlock(nn.Module):
    """Self-attention + MLP, from plain torch modules, no dropout.

    ``causal``: mask future positions (GPT). ``pre_ln``: LayerNorm before
    each sublayer (GPT-2) instead of after the residual (BERT)."""

    def __init__(self, d_model: int, n_heads: int, *, causal: bool, pre_ln: bool, mlp_ratio: int = 4):
        super().__init__()
        self.pre_ln = pre_ln
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_heads, dropout=0.0, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(), nn.Linear(mlp_ratio * d_model, d_model)
        )
        self.causal = causal

    #: The rank's context group where its stage cuts sequences (``context_parallel.py``).
    context: ContextGroup | None = None

    def _attend(self, h):
        return self_attention(self.attn, h, causal=self.causal, context=self.context)

    def forward(self, x):
        if self.pre_ln:
            x = x + self._attend(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self._attend(x))
        return self.ln2(x + self.mlp(x))

    def shard(self, split: SplitGroup) -> nn.Module:
        """Megatron-LM's split of the block (``split_patterns``, where the
        model declares them: "megatron-block")."""
        return ShardedBlock(self, split)


class _TokenEmbedding(nn.Module):
    """Token + learned position embeddings (+ LayerNorm for BERT)."""

    def __init__(self, vocab: int, seq: int, d_model: int, norm: bool):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.norm = nn.LayerNorm(d_model) if norm else nn.Identity()

    #: Where the stage cuts sequences: the positions of the rank's tokens are its chunks'.
    context: ContextGroup | None = None

    def forward(self, ids):
        return self.norm(self.tok(ids) + self.pos(token_positions(ids.shape[1], self.context, ids.device)))

    def shard(self, split: SplitGroup) -> nn.Module:
        """The token embedding split over the vocabulary."""
        return ShardedEmbedding(self, split)


class _LMHead(nn.Module):
    def __init__(self, d_model: int, vocab: int):
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.proj = nn.Linear(d_model, vocab, bias=False)

    #: Each token's logits alone: a cut sequence needs nothing of the other ranks.
    context: ContextGroup | None = None

    def forward(self, x):
        return self.proj(self.ln(x))

    def shard(self, split: SplitGroup) -> nn.Module:
        """The projection split over the vocabulary, with a distributed
        softmax in its loss (SP1)."""
        return ShardedLMHead(self, split)


class _Transformer(nn.Module):
    """The whole model, forward written out (tests compare it with the layer chain)."""

    def __init__(self, embedding: nn.Module, blocks: list[nn.Module], head: nn.Module):
        super().__init__()
        self.embedding = embedding
        self.blocks = nn.ModuleList(blocks)
        self.head = head

    def forward(self, ids):
        x = self.embedding(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _class_loss(logits, targets):
    return F.cross_entropy(logits, targets)


def _check_sizes(**sizes):
    """Every size a positive integer, and the heads dividing the width."""
    for k, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InvalidInputError(f"{k} must be a positive integer, not {v!r}")
    if "n_heads" in sizes and sizes["d_model"] % sizes["n_heads"]:
        raise InvalidInputError(f"d_model {sizes['d_model']} is not a multiple of n_heads {sizes['n_heads']}")


def _language_model(emb: nn.Module, blocks: list[nn.Module], head: nn.Module, name: str, config: dict) -> ModelSpec:
    """A next-token language model: embedding, blocks, LM head; random tokens."""
    vocab, seq = config["vocab"], config["seq"]

    def make_batch(batch_size: int, generator: torch.Generator):
        tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    names = [f"block{i}" for i in range(len(blocks))]
    return ModelSpec(
        layers=[("embedding", emb), *zip(names, blocks), ("lm_head", head)],
        loss=_lm_loss,
        make_batch=make_batch,
        blocks=frozenset(names),
        name=name,
        model=_Transformer(emb, blocks, head),
        config=config,
    )

def gpt(n_layers: int = 4, d_model: int = 64, n_heads: int = 4, seq: int = 32, vocab: int = 256, seed: int = 0) -> ModelSpec:
    """GPT-style decoder: ``embedding``, ``block0`` .. ``block{n-1}`` (causal
    self-attention, pre-LayerNorm), ``lm_head``. Inputs: random token ids
    ``(batch, seq)``; targets: the next token of each position."""
    _check_sizes(n_layers=n_layers, d_model=d_model, n_heads=n_heads, seq=seq, vocab=vocab)
    with _seeded(seed):
        emb = _TokenEmbedding(vocab, seq, d_model, norm=False)
        blocks = [TransformerBlock(d_model, n_heads, causal=True, pre_ln=True) for _ in range(n_layers)]
        head = _LMHead(d_model, vocab)
    # How each layer splits (the profile's ``split``), as the core works it
    # out for analytic transformer profiles, at this model's fp32 values and
    # its own vocabulary: what `dapple profile model` writes, and what
    # `dapple run` checks a split stage against.
    splits = _core.transformer_splits(hidden=d_model, ffn=4 * d_model, heads=n_heads, vocabulary=vocab,
                                      positions=seq, seq_len=seq, value_bytes=4.0)
    emb.split_patterns = [splits["embedding"]]
    for block in blocks:
        block.split_patterns = [splits["block"]]
    head.split_patterns = [splits["lm_head"]]
    config = dict(n_layers=n_layers, d_model=d_model, n_heads=n_heads, seq=seq, vocab=vocab, seed=seed)
    return _language_model(emb, blocks, head, f"gpt-{n_layers}x{d_model}", config)


def gpt_moe(n_layers: int = 4, d_model: int = 64, n_heads: int = 4, seq: int = 32, vocab: int = 256, experts: int = 4,
            experts_per_token: int = 2, expert_ffn: int = 64, seed: int = 0) -> ModelSpec:
    """A GPT whose blocks' MLP is a mixture of experts (``experts.MoEBlock``:
    ``experts`` routed GELU experts of ``expert_ffn`` columns,
    ``experts_per_token`` a token, Mixtral's routing): ``embedding``,
    ``block0`` .. ``block{n-1}``, ``lm_head``; the GPT's inputs and targets.
    Its blocks spread their experts over a stage's expert groups (the
    profile's ``experts``), and do not split; the embedding and the head
    split as the GPT's do."""
    _check_sizes(n_layers=n_layers, d_model=d_model, n_heads=n_heads, seq=seq, vocab=vocab, experts=experts,
                 experts_per_token=experts_per_token, expert_ffn=expert_ffn)
    if experts_per_token > experts:
        raise InvalidInputError(f"experts_per_token {experts_per_token} is more than the {experts} experts")
    with _seeded(seed):
        emb = _TokenEmbedding(vocab, seq, d_model, norm=False)
        blocks = [MoEBlock(d_model, n_heads, experts=experts, per_token=experts_per_token, expert_ffn=expert_ffn)
                  for _ in range(n_layers)]
        head = _LMHead(d_model, vocab)
    # The experts' pattern as the core works it out for analytic profiles
    # with experts, at this model's fp32 values (the blocks' dense parts
    # keep the GPT's biases, the experts have none).
    splits = _core.transformer_splits(hidden=d_model, ffn=0, heads=n_heads, vocabulary=vocab, positions=seq,
                                      seq_len=seq, value_bytes=4.0, experts=experts,
                                      experts_per_token=experts_per_token, expert_ffn=expert_ffn)
    emb.split_patterns = [splits["embedding"]]
    for block in blocks:
        block.expert_pattern = splits["block_experts"]
    head.split_patterns = [splits["lm_head"]]
    config = dict(n_layers=n_layers, d_model=d_model, n_heads=n_heads, seq=seq, vocab=vocab, experts=experts,
                  experts_per_token=experts_per_token, expert_ffn=expert_ffn, seed=seed)
    return _language_model(emb, blocks, head, f"gpt-moe-{n_layers}x{d_model}-e{experts}", config)


def _digits_split(validation_share: float = 0.2):
    """scikit-learn's handwritten digits (1,797 8x8 images, shipped inside
    the package: no download), pixels scaled to [0, 1], split once with a
    fixed permutation into training and validation samples."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise InvalidInputError("the digits model needs scikit-learn: pip install 'dapple[torch]'") from None
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    n_val = round(len(y) * validation_share)
    val, train = order[:n_val], order[n_val:]
    return (x[train], y[train]), (x[val], y[val])


def digits(n_layers: int = 4, hidden: int = 64, seed: int = 0) -> ModelSpec:
    """A classifier of scikit-learn's handwritten digits: ``fc0`` ..
    ``fc{n-2}`` (linear + ReLU), ``head`` (linear to 10 classes). Batches
    are drawn from the training split (1,438 samples) without replacement
    within a batch; ``validation()`` is the other 359."""
    _check_sizes(n_layers=n_layers, hidden=hidden)
    if n_layers < 2:
        raise InvalidInputError(f"n_layers must be at least 2 (hidden layers and a head), not {n_layers}")
    (x_train, y_train), held_out = _digits_split()
    with _seeded(seed):
        widths = [x_train.shape[1]] + [hidden] * (n_layers - 1)
        layers = [(f"fc{i}", nn.Sequential(nn.Linear(widths[i], widths[i + 1]), nn.ReLU()))
                  for i in range(n_layers - 1)]
        layers.append(("head", nn.Linear(widths[-1], 10)))

    def make_batch(batch_size: int, generator: torch.Generator):
        if batch_size > len(y_train):
            raise InvalidInputError(f"a batch of {batch_size} is more than the {len(y_train)} training digits")
        pick = torch.randperm(len(y_train), generator=generator)[:batch_size]
        return x_train[pick], y_train[pick]

    return ModelSpec(
        layers=layers,
        loss=_class_loss,
        make_batch=make_batch,
        blocks=frozenset(name for name, _ in layers[:-1]),
        name=f"digits-{n_layers}x{hidden}",
        config=dict(n_layers=n_layers, hidden=hidden, seed=seed),
        validation=lambda: held_out,
        train_size=len(y_train),
        classifies=True,
    )


class _ClassifierHead(nn.Module):
    """BERT pooler (first token, dense + tanh) and a linear classifier."""

    def __init__(self, d_model: int, n_classes: int):
        super().__init__()
        self.pool = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, n_classes)

    def forward(self, x):
        return self.out(torch.tanh(self.pool(x[:, 0])))


def bert(
    n_layers: int = 4, d_model: int = 64, n_heads: int = 4, seq: int = 32, vocab: int = 256, n_classes: int = 2, seed: int = 0
) -> ModelSpec:
    """BERT-style encoder: ``embedding`` (token + position + LayerNorm),
    ``block0`` .. (bidirectional self-attention, post-LayerNorm),
    ``classifier`` on the first token. Inputs: random token ids; targets:
    random class labels."""
    _check_sizes(n_layers=n_layers, d_model=d_model, n_heads=n_heads, seq=seq, vocab=vocab, n_classes=n_classes)
    with _seeded(seed):
        emb = _TokenEmbedding(vocab, seq, d_model, norm=True)
        blocks = [TransformerBlock(d_model, n_heads, causal=False, pre_ln=False) for _ in range(n_layers)]
        head = _ClassifierHead(d_model, n_classes)
    model = _Transformer(emb, blocks, head)

    def make_batch(batch_size: int, generator: torch.Generator):
        tokens = torch.randint(0, vocab, (batch_size, seq), generator=generator)
        labels = torch.randint(0, n_classes, (batch_size,), generator=generator)
        return tokens, labels

    names = [f"block{i}" for i in range(n_layers)]
    return ModelSpec(
        layers=[("embedding", emb), *zip(names, blocks), ("classifier", head)],
        loss=_class_loss,
        make_batch=make_batch,
        blocks=frozenset(names),
        name=f"bert-{n_layers}x{d_model}",
        model=model,
        config=dict(n_layers=n_layers, d_model=d_model, n_heads=n_heads, seq=seq, vocab=vocab, n_classes=n_classes, seed=seed),
    )


class _VGG(nn.Module):
    def __init__(self, blocks: list[nn.Module], head: nn.Module):
        super().__init__()
        self.features = nn.ModuleList(blocks)
        self.head = head

    def forward(self, images):
        x = images
        for block in self.features:
            x = block(x)
        return self.head(x)


def vgg(
    channels: tuple[int, ...] | list[int] = (16, 32, 64),
    convs_per_block: int = 2,
    hidden: int = 128,
    n_classes: int = 10,
    image_size: int = 32,
    seed: int = 0,
) -> ModelSpec:
    """VGG-style CNN on 3x``image_size``x``image_size`` images: ``block0`` ..
    (``convs_per_block`` 3x3 conv + ReLU, then 2x2 max-pool), ``classifier``
    (flatten, FC + ReLU, FC to ``n_classes``). No batch norm, no dropout."""
    channels = tuple(channels)
    _check_sizes(convs_per_block=convs_per_block, hidden=hidden, n_classes=n_classes, image_size=image_size)
    if not channels:
        raise InvalidInputError("channels must name at least one block")
    _check_sizes(**{f"channels[{i}]": c for i, c in enumerate(channels)})
    side = image_size >> len(channels)
    if side < 1:
        raise InvalidInputError(f"image_size {image_size} is too small for {len(channels)} pooling blocks")
    with _seeded(seed):
        blocks = []
        c_in = 3
        for c in channels:
            mods: list[nn.Module] = []
            for _ in range(convs_per_block):
                mods += [nn.Conv2d(c_in, c, 3, padding=1), nn.ReLU()]
                c_in = c
            mods.append(nn.MaxPool2d(2))
            blocks.append(nn.Sequential(*mods))
        head = nn.Sequential(nn.Flatten(), nn.Linear(c_in * side * side, hidden), nn.ReLU(), nn.Linear(hidden, n_classes))
    model = _VGG(blocks, head)

    def make_batch(batch_size: int, generator: torch.Generator):
        images = torch.randn(batch_size, 3, image_size, image_size, generator=generator)
        labels = torch.randint(0, n_classes, (batch_size,), generator=generator)
        return images, labels

    names = [f"block{i}" for i in range(len(channels))]
    return ModelSpec(
        layers=[*zip(names, blocks), ("classifier", head)],
        loss=_class_loss,
        make_batch=make_batch,
        blocks=frozenset(names),
        name=f"vgg-{len(channels)}x{convs_per_block}",
        model=model,
        config=dict(channels=list(channels), convs_per_block=convs_per_block, hidden=hidden, n_classes=n_classes,
                    image_size=image_size, seed=seed),
    )


# ------------------------------------------------------ Hugging Face GPT-2


class _HFEmbedding(nn.Module):
    def __init__(self, wte: nn.Module, wpe: nn.Module):
        super().__init__()
        self.wte = wte
        self.wpe = wpe

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.wte(ids) + self.wpe(positions)


class _HFBlock(nn.Module):
    """A GPT2Block taking and returning one tensor. The causal mask is passed
    explicitly (additive, ``(1, 1, seq, seq)``), so it holds whether or not
    the installed transformers version also masks inside the block."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        n = x.shape[1]
        mask = torch.full((n, n), torch.finfo(x.dtype).min, device=x.device, dtype=x.dtype).triu(1)[None, None]
        out = self.block(x, attention_mask=mask, use_cache=False)
        return out[0] if isinstance(out, (tuple, list)) else out


def hf_gpt2(n_layers: int = 2, d_model: int = 64, n_heads: int = 4, seq: int = 32, vocab: int = 256, seed: int = 0) -> ModelSpec:
    """A tiny GPT-2 from ``transformers.GPT2Config`` with random weights (no
    hub access): ``embedding``, ``block0`` .., ``lm_head`` (untied from the
    token embedding, so the layers share no parameters). Needs the optional
    ``transformers`` package; raises InvalidInputError without it."""
    try:
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    except ImportError as e:
        raise InvalidInputError(f"hf_gpt2 needs the transformers package ({e})") from None
    _check_sizes(n_layers=n_layers, d_model=d_model, n_heads=n_heads, seq=seq, vocab=vocab)
    config = GPT2Config(
        vocab_size=vocab, n_positions=seq, n_embd=d_model, n_layer=n_layers, n_head=n_heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )
    try:
        config._attn_implementation = "eager"
    except Exception:  # noqa: BLE001 - older/newer config classes
        pass
    with _seeded(seed):
        emb = _HFEmbedding(nn.Embedding(vocab, d_model), nn.Embedding(seq, d_model))
        blocks = []
        for i in range(n_layers):
            try:
                block = GPT2Block(config, layer_idx=i)
            except TypeError:
                block = GPT2Block(config)
            blocks.append(_HFBlock(block))
        head = nn.Sequential(nn.LayerNorm(d_model, eps=config.layer_norm_epsilon), nn.Linear(d_model, vocab, bias=False))
    config = dict(n_layers=n_layers, d_model=d_model, n_heads=n_heads, seq=seq, vocab=vocab, seed=seed)
    return _language_model(emb, blocks, head, f"hf-gpt2-{n_layers}x{d_model}", config)
