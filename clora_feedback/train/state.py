"""Per-agent training state in host memory, and the device slots it is swapped into.

An agent's trainable state is four flat fp32 buffers of equal length: the
LoRA parameters (the fp32 master copy), Adam's first and second moments, and
the gradient. A fixed `LoRALayout` maps the flat buffer to per-projection
views A [r, in] and B [out, r], so a swap is four contiguous copies and an
optimizer step is a handful of vectorised ops, whatever the number of layers.

Host buffers are pinned when CUDA is present (so copies are asynchronous);
`TrainingSlot` holds the device-side twins. On a CPU-only machine the "device"
is host memory too and a swap is a memcpy, still measured and logged.

`Residency` bounds how many agents keep their buffers in host memory
(`trainer.max_resident_agents`): beyond it the least recently stepped agent's
buffers are dropped (`AgentTrainState.drop`; its step count, version and
baseline stay) and restored before its next step from its version's directory,
which holds exactly those weights and Adam moments (`restore`: bit-identical).

Not here: forward/backward (see `forward`), losses (`loss`), scheduling (`trainer`).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from clora_feedback.lora.weights import LoRALimits, LoRAWeights, module_key


@dataclass(frozen=True)
class LoRALayout:
    """Where each projection's A and B live inside a flat parameter buffer.

    Attributes:
        rank: LoRA rank r.
        alpha: LoRA alpha (scaling = alpha / r).
        entries: (key, offset_a, shape_a, offset_b, shape_b) in a fixed order.
        numel: total number of parameters.
    """

    rank: int
    alpha: float
    entries: tuple[tuple[str, int, tuple[int, int], int, tuple[int, int]], ...]
    numel: int

    @classmethod
    def build(
        cls, limits: LoRALimits, rank: int, alpha: float, target_modules: tuple[str, ...]
    ) -> LoRALayout:
        entries = []
        offset = 0
        for layer in range(limits.num_layers):
            for name in target_modules:
                fan_in, fan_out = limits.shapes[name]
                a_shape, b_shape = (rank, fan_in), (fan_out, rank)
                entries.append(
                    (module_key(layer, name), offset, a_shape, offset + rank * fan_in, b_shape)
                )
                offset += rank * fan_in + fan_out * rank
        return cls(rank, alpha, tuple(entries), offset)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def views(self, flat: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per-projection (A, B) views into `flat` (no copies; gradients flow to `flat`)."""
        out = {}
        for key, oa, sa, ob, sb in self.entries:
            a = flat[oa : oa + sa[0] * sa[1]].view(sa)
            b = flat[ob : ob + sb[0] * sb[1]].view(sb)
            out[key] = (a, b)
        return out

    def split_views(self, flat: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Like `views`, but made with one `split`, so backward gathers all gradients in one
        concatenation instead of one full-size buffer per slice (use it inside autograd)."""
        sizes = [n for _, _, sa, _, sb in self.entries for n in (sa[0] * sa[1], sb[0] * sb[1])]
        pieces = flat.split(sizes)
        return {
            key: (pieces[2 * i].view(sa), pieces[2 * i + 1].view(sb))
            for i, (key, _, sa, _, sb) in enumerate(self.entries)
        }

    def to_weights(self, flat: torch.Tensor) -> LoRAWeights:
        """A detached fp32 copy as `LoRAWeights` (what the engine and the registry take)."""
        copy = flat.detach().to("cpu", torch.float32, copy=True)
        return LoRAWeights(rank=self.rank, alpha=self.alpha, tensors=self.views(copy))

    def from_weights(self, weights: LoRAWeights) -> torch.Tensor:
        """Flatten `weights` into this layout (missing projections are zero)."""
        flat = torch.zeros(self.numel, dtype=torch.float32)
        views = self.views(flat)
        for key, (a, b) in weights.tensors.items():
            if key in views:
                views[key][0].copy_(a)
                views[key][1].copy_(b)
        return flat


def init_lora(layout: LoRALayout, *, seed: int) -> torch.Tensor:
    """Standard LoRA init: A ~ Kaiming-uniform, B = 0 (the adapter starts as the identity)."""
    flat = torch.zeros(layout.numel, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    for a, _ in layout.views(flat).values():
        bound = 1.0 / math.sqrt(a.shape[1])
        a.uniform_(-bound, bound, generator=gen)
    return flat


def _host_buffer(numel: int) -> torch.Tensor:
    buf = torch.zeros(numel, dtype=torch.float32)
    return buf.pin_memory() if torch.cuda.is_available() else buf


@dataclass
class AgentTrainState:
    """One agent's trainable state, resident in host memory between steps.

    Attributes:
        agent: the agent.
        layout: where A/B live in the flat buffers.
        params: [P] fp32 master LoRA parameters.
        exp_avg: [P] Adam first moment.
        exp_avg_sq: [P] Adam second moment.
        step: optimizer steps taken.
        version: adapter version these parameters were published as (or loaded from).
        baseline: running mean reward (the advantage baseline when samples have no group).
        lr_scale: multiplies the learning rate of this agent's steps (the release path's
            back-off after a rejected candidate, `train.lineage`).
    """

    agent: str
    layout: LoRALayout
    params: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int = 0
    version: int = 0
    baseline: float | None = None
    lr_scale: float = 1.0

    @classmethod
    def create(
        cls, agent: str, layout: LoRALayout, params: torch.Tensor, *, version: int = 0
    ) -> AgentTrainState:
        host = _host_buffer(layout.numel)
        host.copy_(params)
        return cls(
            agent,
            layout,
            host,
            _host_buffer(layout.numel),
            _host_buffer(layout.numel),
            version=version,
        )

    @property
    def resident(self) -> bool:
        """Whether the buffers are in host memory (`drop` releases them)."""
        return self.params.numel() == self.layout.numel

    def drop(self) -> None:
        """Release the buffers (3 x 4 bytes per parameter); step, version and baseline stay.
        Only for a state its version's directory holds exactly (`restore` reads it back)."""
        empty = torch.empty(0, dtype=torch.float32)
        self.params, self.exp_avg, self.exp_avg_sq = empty, empty.clone(), empty.clone()

    def restore(self, params: torch.Tensor, optimizer: dict[str, torch.Tensor] | None) -> None:
        """Bring dropped buffers back from what the version's directory stored.

        Args:
            params: [P] fp32 parameters in this state's layout.
            optimizer: the stored `optimizer_state()` (None: the version has none, so its
                moments were zero: a fresh adapter's).
        """
        self.params = _host_buffer(self.layout.numel)
        self.params.copy_(params)
        self.exp_avg = _host_buffer(self.layout.numel)
        self.exp_avg_sq = _host_buffer(self.layout.numel)
        if optimizer is None:  # moments of a version stored without any: zero, as published
            self.exp_avg.zero_()
            self.exp_avg_sq.zero_()
        else:
            self.load_optimizer_state(optimizer)

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """What the registry stores next to the PEFT files."""
        return {
            "exp_avg": self.exp_avg.detach().cpu().clone(),
            "exp_avg_sq": self.exp_avg_sq.detach().cpu().clone(),
            "step": torch.tensor([self.step], dtype=torch.int64),
        }

    def load_optimizer_state(self, state: dict[str, torch.Tensor] | None) -> None:
        if state is None or state["exp_avg"].numel() != self.layout.numel:
            self.exp_avg.zero_()
            self.exp_avg_sq.zero_()
            self.step = 0
            return
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        self.step = int(state["step"].item())


class Residency:
    """Which agents' training buffers stay in host memory: at most `capacity`, least
    recently stepped dropped first (`AgentTrainState.drop`), restored on demand.

    Args:
        capacity: agents kept resident (None: all).
        restore: reads a dropped state's buffers back (`AgentTrainState.restore` from its
            version's directory); may raise, and then the caller starts the agent over.
    """

    def __init__(self, capacity: int | None, restore: Callable[[AgentTrainState], None]) -> None:
        self.capacity = capacity
        self._restore = restore
        self._states: OrderedDict[str, AgentTrainState] = OrderedDict()  # least recent first
        self.drops = 0
        self.restores = 0

    def use(self, state: AgentTrainState) -> None:
        """`state` is about to step: restore it if dropped, mark it most recently used."""
        if not state.resident:
            self._restore(state)
            self.restores += 1
        self._states[state.agent] = state
        self._states.move_to_end(state.agent)

    def add(self, state: AgentTrainState) -> None:
        """Track a newly loaded state, as the least recently used (it has not stepped yet)."""
        self._states[state.agent] = state
        self._states.move_to_end(state.agent, last=False)
        self.trim()

    def forget(self, agent: str) -> None:
        """`agent`'s run is gone (its state is no longer tracked)."""
        self._states.pop(agent, None)

    def trim(self) -> None:
        """Drop the least recently used resident states beyond `capacity`."""
        if self.capacity is None:
            return
        resident = [s for s in self._states.values() if s.resident]
        for state in resident[: max(0, len(resident) - self.capacity)]:
            state.drop()
            self.drops += 1

    @property
    def resident(self) -> int:
        """States whose buffers are in host memory now."""
        return sum(1 for s in self._states.values() if s.resident)


@dataclass
class TrainingSlot:
    """Device-side buffers one agent's state is swapped into for a step."""

    capacity: int
    device: torch.device
    params: torch.Tensor = field(init=False)
    exp_avg: torch.Tensor = field(init=False)
    exp_avg_sq: torch.Tensor = field(init=False)
    owner: AgentTrainState | None = None
    last_swap_s: float = 0.0

    def __post_init__(self) -> None:
        self.params = torch.zeros(self.capacity, dtype=torch.float32, device=self.device)
        self.exp_avg = torch.zeros_like(self.params)
        self.exp_avg_sq = torch.zeros_like(self.params)

    def swap_in(self, state: AgentTrainState) -> torch.Tensor:
        """Copy `state` onto the device; returns the trainable [P] parameter leaf."""
        t0 = time.perf_counter()
        n = state.layout.numel
        if n > self.capacity:
            raise ValueError(
                f"agent {state.agent}: {n} parameters exceed the slot's {self.capacity}"
            )
        nb = self.device.type == "cuda"
        self.params[:n].copy_(state.params, non_blocking=nb)
        self.exp_avg[:n].copy_(state.exp_avg, non_blocking=nb)
        self.exp_avg_sq[:n].copy_(state.exp_avg_sq, non_blocking=nb)
        if nb:
            torch.cuda.synchronize(self.device)
        self.owner = state
        self.last_swap_s = time.perf_counter() - t0
        leaf = self.params[:n].detach().requires_grad_(True)
        return leaf

    def swap_out(self, leaf: torch.Tensor) -> float:
        """Copy the (updated) device state back to the owner's host buffers; returns seconds spent."""
        state = self.owner
        if state is None:
            raise RuntimeError("swap_out without swap_in")
        t0 = time.perf_counter()
        n = state.layout.numel
        state.params.copy_(leaf.detach())
        state.exp_avg.copy_(self.exp_avg[:n])
        state.exp_avg_sq.copy_(self.exp_avg_sq[:n])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.owner = None
        seconds = time.perf_counter() - t0
        self.last_swap_s += seconds
        return seconds


@dataclass(frozen=True)
class AdamConfig:
    """AdamW hyper-parameters (LoRA wants ~10x the full fine-tuning learning rate)."""

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    warmup_steps: int = 0

    def lr_at(self, step: int) -> float:
        """The learning rate of update `step` (>= 1): linear warm-up over `warmup_steps`."""
        if self.warmup_steps <= 0:
            return self.lr
        return self.lr * min(1.0, step / self.warmup_steps)


def adam_step(
    params: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    cfg: AdamConfig,
) -> float:
    """One AdamW update in place on flat buffers (after gradient-norm clipping).

    torch's fused AdamW kernel (the one `torch.optim.AdamW(fused=True)` runs):
    one pass over the four buffers instead of a dozen elementwise ops, each a
    pass over memory; the same update as the textbook's (decoupled weight decay,
    bias-corrected moments, eps added to the corrected root).

    Args:
        params, grad, exp_avg, exp_avg_sq: [P] fp32 buffers.
        step: the step number after this update (>= 1).
        cfg: hyper-parameters.

    Returns:
        The gradient norm before clipping.
    """
    with torch.no_grad():
        norm = float(grad.norm().item())
        if cfg.max_grad_norm > 0 and norm > cfg.max_grad_norm:
            grad = grad * (cfg.max_grad_norm / (norm + 1e-12))
        b1, b2 = cfg.betas
        torch._fused_adamw_(
            [params],
            [grad],
            [exp_avg],
            [exp_avg_sq],
            [],
            [torch.tensor(float(step), device=params.device)],
            lr=cfg.lr_at(step),
            beta1=b1,
            beta2=b2,
            weight_decay=cfg.weight_decay,
            eps=cfg.eps,
            amsgrad=False,
            maximize=False,
        )
    return norm
