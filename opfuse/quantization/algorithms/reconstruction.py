"""Block reconstruction: the int8 weights' rounding learned and the activations' scales
learned or searched, block by block, to reproduce the float model's block outputs on the
calibration data.

Li et al., "BRECQ: Pushing the Limit of Post-Training Quantization by Block
Reconstruction" (ICLR 2021), with Esser et al.'s learned step sizes (LSQ, ICLR 2020) for
the CPU presets and a search of the scales for the ``qnn`` ones. AdaRound
(:mod:`.adaround`) fits each layer alone; fitting a block jointly is what holds a model
whose layers' errors interact (docs/quantization.md gives the measurements).

The algebra, for a block B of the QDQ graph (a run of its compute nodes, with the
QuantizeLinear/DequantizeLinear pairs on their inputs), its quantised input xq (the
quantised model reconstructed so far, blocks earlier in graph order already fixed) and the
float model's output y = B_float(x) at each tensor B hands on:

    minimise  E = sum over B's outputs t of mean( w_t[c] * (act(Bq(xq))_t - y_t)^2 ) / E_nearest
              + lambda * mean over weights of (1 - |2 h - 1|^beta)
    weights   Wq = s_w * (clip(floor(W / s_w) + h + z, lo, hi) - z),
              h = clip(sigmoid(V) (zeta - gamma) + gamma, 0, 1)            (AdaRound)
    activations fq(x) = s * (clip(round(x / s) + z, lo, hi) - z), each s chosen before the
              rounding fit by a coordinate search (``scale_fit="search"``: s times each of
              :data:`SCALE_STEPS`, kept where the block error with the rounding as it stands
              falls), then fixed; or learned in the fit ("learned", LSQ: the gradient
              reaches s through round() as if it were the identity)
    biases    bq = s_x s_w round(b / (s_x s_w)): the int32 bias ONNX Runtime's kernels read,
              re-quantised to the learned input scale, as it will be written

``act`` is the Relu or Clip the quantiser removed after a layer (its output range clips
instead), ``E_nearest`` the error with the rounding and scales ONNX Runtime chose, and
``w_t[c]`` each channel's share of the float model's output sensitivity: a Hutchinson
estimate of diag(J^T J) of the graph outputs with respect to t (two probes per sample,
normalised to mean 1), so that the error a channel makes counts as much as it reaches the
outputs. V (and log(s), when learned) are fitted with Adam on :data:`PER_STEP` samples per
step for :data:`ITERATIONS` steps, lambda and beta as in AdaRound (no regulariser for the first
:data:`.rounding.WARMUP` of the steps, then beta from 20 to 2: :mod:`.rounding`, the relaxation both
fits share), and h is then set to 0 or 1.

The scales are searched for the ``qnn`` presets (:attr:`.presets.Preset.scale_fit`), which
quantise the residual stream too: there LSQ's straight-through gradient of the block error
with respect to log(s) disagreed in sign with a finite difference, and left blocks worse
than they began; for the CPU presets (residual Adds in float) LSQ reads as well and costs
less (docs/quantization.md).

The starting point is ONNX Runtime's quantisation itself, not the model after AdaRound or
bias correction: a correction fitted to the rounding this replaces is wrong for the one it
learns. The caller corrects the biases again afterwards.

Blocks: the QDQ graph's compute nodes in graph order, cut where every tensor crossing the
cut is one the float model has (so each block output has a target) and is read through a
QuantizeLinear alone (so the next block starts at its quantiser, and a Relu the quantiser
kept is inside the block that computes its input), closed once a block holds
:data:`.qdq_program.LAYERS_PER_BLOCK` int8 weights and one tensor crosses (any number once
it holds four times as many). A tensor that depends on no QuantizeLinear (an attention
mask, a shape) is computed once per sample.

Legality and limits (each refusal is recorded with its reason):
- the graph is interpreted in torch (:mod:`.qdq_program`, :mod:`.torch_ops`); it is
  reconstructed up to the first node the interpreter does not know, the rest stays as
  ONNX Runtime quantised it;
- a weight is learned where AdaRound would learn one (:func:`.adaround.weight_sites`: Conv, Gemm,
  MatMul with a constant weight read by that layer alone); other int8 constants stay;
- an activation scale is learned where it is per tensor; a QuantizeLinear after an op that
  only moves values (Reshape, Transpose...) shares its input's learned scale, as ONNX
  Runtime gave it; the scales of the tensors a device names (``kept_scales``: the ``ethos-u``
  device's, which TFLite's kernels fix or share) are not learned;
- output sensitivities need the whole float model in torch; otherwise every channel counts
  alike, and the report says so;
- a block whose error (as weighted above, on all the samples) ends above where it began is
  left as it was;
- the result is a candidate only: the caller (:func:`.pipeline.quantize`) keeps it when it
  raises the output SQNR on the tuning samples (some fits end worse than where they began).

Cost: per step, the block forward and backward on :data:`PER_STEP` samples;
:func:`estimated_seconds` tells it beforehand from one forward and backward pass of the
float model. The scale search adds, per scale key, one pass of the block up to the key's
first reader and :data:`SCALE_STEPS` passes of the rest, on :data:`SEARCH_SAMPLES` samples;
it is not in the estimate (it runs only for the ``qnn`` presets, whose default multiplies
the estimate by :data:`.pipeline.QNN_FIT_FACTOR` instead). Transformer blocks hold many
keys, so there the search costs more than the fit (measured times: docs/quantization.md).
"""

from __future__ import annotations

__all__ = ["BlockResult", "Reconstruction", "reconstruct", "apply_reconstruction", "estimated_seconds"]

import dataclasses
import math
import time
from collections.abc import Collection

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from opfuse.quantization.options import RECONSTRUCTION_ITERATIONS
from opfuse.quantization.algorithms.rounding import (
    FRACTION_CLIP,
    GAMMA,
    REGULARISER,
    ZETA,
    beta_at,
    initial_v,
    optimiser,
    warmup_steps,
)
from opfuse.quantization.interpreter.program import Block, FloatProgram, QdqProgram

ITERATIONS = RECONSTRUCTION_ITERATIONS  # the default of QuantizeOptions.reconstruction_iterations
PER_STEP = 4  # samples per Adam step
SAMPLES = 48  # tuning samples used at most
SCALE_LEARNING_RATE = 1e-3  # log(s), when learned
# activation scales: learned in the fit (LSQ) or searched before it
SCALE_FITS = ("learned", "search")
SCALE_STEPS = (0.7, 0.8, 0.9, 0.95, 1.05, 1.1, 1.25, 1.5)  # the factors the search tries on each scale
SEARCH_SAMPLES = 16  # samples the search measures each trial on
MACS_PER_SECOND = 2.0e9  # the fits' pace on one thread here, fitted to three models (estimated_seconds)
SECONDS_PER_NODE = 5e-4  # and the per-node cost of one sample's pass


@dataclasses.dataclass
class BlockResult:
    """One block: its layers, and its outputs' SQNR against the float model's (dB) with ONNX
    Runtime's rounding and scales, then with the learned ones."""

    layers: list[str]
    nearest_db: float
    reconstructed_db: float
    flipped: float  # share of the block's int8 weights whose integer changed
    seconds: float
    kept: bool = True  # False: its weighted error on the samples ended above where it began


@dataclasses.dataclass
class Reconstruction:
    """The initializers to write (name -> values) and what each block measured."""

    values: dict[str, np.ndarray]
    blocks: list[BlockResult]
    stopped: str = ""  # why the reconstruction ends before the graph does ("" : it covers it)
    weighted: bool = True  # errors weighted by output sensitivity
    unweighted_reason: str = ""
    seconds: float = 0.0

    @property
    def layers(self) -> int:
        return sum(len(b.layers) for b in self.blocks)


def apply_reconstruction(qdq: onnx.ModelProto, result: Reconstruction) -> None:
    """Writes the learned initializers into ``qdq`` (in place)."""
    for tensor in qdq.graph.initializer:
        if tensor.name in result.values:
            tensor.CopyFrom(numpy_helper.from_array(result.values[tensor.name], tensor.name))


def estimated_seconds(float_model: onnx.ModelProto, sample, iterations: int = ITERATIONS) -> tuple[float | None, str]:
    """What :func:`reconstruct` will take, counted rather than timed (so that the answer does
    not depend on the machine's load): per step and sample, the float model's
    multiply-accumulates at :data:`MACS_PER_SECOND` plus :data:`SECONDS_PER_NODE` a node.
    The two constants are fitted to measured fits of three models on one thread
    (docs/quantization.md, "What block reconstruction costs").
    Returns (seconds, "") or (None, why it cannot be told)."""
    reference = FloatProgram(float_model)
    if reference.unsupported:
        return None, f"the float model is not interpreted in torch past {reference.unsupported}"
    with torch.no_grad():
        macs = reference.multiply_accumulates(sample)
    per_pass = macs / MACS_PER_SECOND + len(reference.functions) * SECONDS_PER_NODE
    return per_pass * PER_STEP * iterations, ""


def reconstruct(float_model: onnx.ModelProto, qdq: onnx.ModelProto, samples, *, seed: int = 0,
                iterations: int = ITERATIONS, scale_fit: str = "learned", progress=None,
                kept_scales: Collection[str] = ()) -> Reconstruction:
    """Learns the rounding and activation scales of ``qdq`` block by block on ``samples``
    (the tuning samples; module docstring), the activation scales as ``scale_fit`` says
    (:data:`SCALE_FITS`), except those of the tensors in ``kept_scales`` (a device's own: the
    ``ethos-u`` device's fixed and shared quantisations), which stay as written, with every
    scale tied to theirs. ``qdq`` is not changed. ``progress(done, blocks, BlockResult)`` is
    called after each block."""
    if scale_fit not in SCALE_FITS:
        raise ValueError(f"scale_fit is one of {SCALE_FITS}, not {scale_fit!r}")
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    samples = [dict(s) for s in list(samples)[:SAMPLES]]
    program = QdqProgram(float_model, qdq)
    blocks = program.blocks()
    result = Reconstruction(values={}, blocks=[], stopped=program.stopped)
    if not blocks:
        result.stopped = result.stopped or "no block holds an int8 weight"
        return result
    with torch.no_grad():
        quant = [program.static_values(s) for s in samples]
    reference = FloatProgram(float_model)
    wanted = sorted({program.target[t] for b in blocks for t in b.outputs})
    floats = reference.values(samples, wanted)
    sensitivities, reason = reference.sensitivities(samples, wanted, generator)
    result.weighted, result.unweighted_reason = not reason, reason

    state = _State(program, {k: torch.tensor(math.log(v), dtype=torch.float64) for k, v in program.scale_values.items()},
                   program.fixed_weights())
    kept = {n.name for n in qdq.graph.node if n.op_type == "QuantizeLinear" and n.input[0] in set(kept_scales)}
    state.kept = {key for q, key in program.scale_key.items() if q in kept}
    for number, block in enumerate(blocks):
        t0 = time.perf_counter()
        record = _fit_block(state, block, quant, floats, sensitivities, iterations, generator, scale_fit)
        record.seconds = time.perf_counter() - t0
        result.blocks.append(record)
        for env in quant:  # what no later block reads
            for name in [k for k in env if k in program.dependent and k not in block.needed_after]:
                del env[name]
        if progress is not None:
            progress(number + 1, len(blocks), record)
    result.values = program.values(state.integers, {k: float(torch.exp(state.scales[k])) for k in state.learned})
    result.seconds = time.perf_counter() - started
    return result


@dataclasses.dataclass
class _State:
    program: "QdqProgram"
    scales: dict  # scale key -> log(scale), torch float64
    weights: dict  # weight initializer -> the DQ output torch runs with (fixed blocks: their learned rounding)
    integers: dict = dataclasses.field(default_factory=dict)  # weight initializer -> learned integers (own layout)
    learned: set = dataclasses.field(default_factory=set)  # scale keys learned
    kept: set = dataclasses.field(default_factory=set)  # scale keys never learned (reconstruct's kept_scales)

    def exp_scales(self, live=None) -> dict:
        return {k: torch.exp(v) for k, v in {**self.scales, **(live or {})}.items()}


def _soft_weights(sites) -> tuple[dict, dict, dict, dict]:
    """Per site: AdaRound's variable V such that the soft weight starts at the float weight, and
    the floor, step and zero point it is rounded on."""
    variables, floors, steps, zeros = {}, {}, {}, {}
    for site in sites:
        w, s = torch.tensor(site.float_weight), torch.tensor(site.scale)
        floors[site.name], steps[site.name], zeros[site.name] = torch.floor(w / s), s, torch.tensor(site.zero)
        rest = torch.clamp(w / s - floors[site.name], *FRACTION_CLIP)
        variables[site.name] = initial_v(rest, torch.log).requires_grad_(True)
    return variables, floors, steps, zeros


def _fit_block(state: _State, block: Block, quant, floats, sensitivities, iterations, generator,
               scale_fit: str) -> BlockResult:
    program = state.program
    sites = [program.sites[n] for n in block.layers]
    keys = sorted({program.scale_key[q] for q in block.quantizers if q in program.scale_key} - state.kept)
    variables, floors, steps, zeros = _soft_weights(sites)
    log_scales = {k: state.scales[k].detach().clone().requires_grad_(True) for k in keys}

    def integers(site, h):
        return torch.clamp(floors[site.name] + h + zeros[site.name], *site.levels)

    def weights_with(h_of):
        out = dict(state.weights)
        for site in sites:
            q = integers(site, h_of(site))
            out[site.initializer] = site.to_own((q - zeros[site.name]) * steps[site.name]).float()
        return out

    def error(env, index):
        total = 0.0
        for target, got, want in _compared(program, block, env, floats[index]):
            d = (got - want) ** 2
            w = sensitivities.get(target)
            total = total + ((d * w).mean() if w is not None else d.mean())
        return total

    count = len(quant)
    with torch.no_grad():  # the rounding and scales as they stand
        scales = state.exp_scales()
        near = [program.run(dict(quant[i]), block.nodes, state.weights, scales) for i in range(count)]
        e_near = max(float(sum(error(near[i], i) for i in range(count))) / count, 1e-30)
    learned_scales = list(log_scales.values()) if scale_fit == "learned" else []
    groups = [g for g in ({"params": list(variables.values())},
                          {"params": learned_scales, "lr": SCALE_LEARNING_RATE}) if g["params"]]
    before = _block_db(near, floats, block, program)
    if not groups:
        _hand_on(quant, near, block)
        return BlockResult(block.layers, before, before, 0.0, 0.0)
    if scale_fit == "search" and keys:
        _search_scales(log_scales, _BlockError(program, block, quant[:SEARCH_SAMPLES], state, error))
    adam = optimiser(groups)
    warm = warmup_steps(iterations)
    total_weights = max(1, sum(v.numel() for v in variables.values()))
    for step in range(iterations):
        picks = torch.randint(0, count, (min(PER_STEP, count),), generator=generator).tolist()
        weights, scales = weights_with(lambda site: _rectified(variables[site.name])), state.exp_scales(log_scales)
        loss = sum(error(program.run(dict(quant[i]), block.nodes, weights, scales), i)
                   for i in picks) / (len(picks) * e_near)
        if step >= warm and variables:
            beta = beta_at(step - warm, max(1, iterations - warm))
            regular = sum((1 - (2 * _rectified(v) - 1).abs() ** beta).sum() for v in variables.values())
            loss = loss + REGULARISER * regular / total_weights
        adam.zero_grad()
        loss.backward()
        adam.step()
    with torch.no_grad():
        learned = dict(state.scales)
        learned.update({k: v.detach().clone() for k, v in log_scales.items()})
        hard = {site.name: _hardened(variables[site.name]) for site in sites}  # h in {0, 1}, once
        weights = weights_with(lambda site: hard[site.name])
        scales = {k: torch.exp(v) for k, v in learned.items()}
        final = [program.run(dict(quant[i]), block.nodes, weights, scales) for i in range(count)]
        e_final = float(sum(error(final[i], i) for i in range(count))) / count
        if e_final >= e_near:  # the fit ends worse than it began: the block stays as it was
            _hand_on(quant, near, block)
            return BlockResult(block.layers, before, before, 0.0, 0.0, kept=False)
        state.scales, state.weights = learned, weights
        state.learned.update(log_scales)
        changed = total = 0
        for site in sites:
            q = site.to_own(integers(site, hard[site.name])).numpy()
            state.integers[site.initializer] = q
            changed += int((q != program.integers(site)).sum())
            total += q.size
    _hand_on(quant, final, block)
    return BlockResult(block.layers, before, _block_db(final, floats, block, program), changed / max(total, 1), 0.0)


class _BlockError:
    """The block's error on ``quant``'s samples with the scales ``live`` (log, by key) and
    the rounding as it stands. Called with ``key``, the nodes before the first that reads
    that key's scale are run once for the key and their values reused by each trial (they do
    not depend on it), so a trial runs only the rest of the block: the same numbers, in
    about half the time."""

    def __init__(self, program: QdqProgram, block: Block, quant, state: _State, error):
        self.program, self.block, self.quant, self.state, self.error = program, block, quant, state, error
        self.first = {}  # key -> index in block.nodes of its first reader
        for index, node in enumerate(block.nodes):
            key = program.scale_read_by(node)
            if key is not None:
                self.first.setdefault(key, index)
        self.prefix_key, self.prefix = None, None

    def __call__(self, live, key=None) -> float:
        program, nodes, weights = self.program, self.block.nodes, self.state.weights
        scales = self.state.exp_scales(live)
        cut = self.first.get(key, 0)
        if cut and key != self.prefix_key:
            self.prefix_key = key
            self.prefix = [program.run(dict(env), nodes[:cut], weights, scales) for env in self.quant]
        starts = self.prefix if cut else self.quant
        return sum(float(self.error(program.run(dict(env), nodes[cut:], weights, scales), i))
                   for i, env in enumerate(starts))


def _search_scales(log_scales: dict, measure) -> None:
    """A coordinate search of the block's activation scales: each in turn (in the order of
    their keys) is multiplied by each of :data:`SCALE_STEPS`, the others as chosen so far,
    and keeps the factor whose ``measure(scales, key)`` (the block's weighted error on the
    samples, the rounding as it stands: :class:`_BlockError`) is lowest, or stays. The
    search never steps up: each key's choice is measured with all the earlier choices in
    place, and stays unless lower."""
    with torch.no_grad():
        current = {k: v.detach().clone() for k, v in log_scales.items()}
        best = measure(current)
        for key in current:
            chosen = current[key]
            for factor in SCALE_STEPS:
                trial = {**current, key: current[key] + math.log(factor)}
                e = measure(trial, key)
                if e < best:
                    best, chosen = e, trial[key]
            current[key] = chosen
        for key, v in current.items():
            log_scales[key].data.copy_(v)


def _hand_on(quant, envs, block) -> None:
    """Later blocks read this block's outputs as now quantised."""
    for env, done in zip(quant, envs):
        for t in block.hands_on:
            env[t] = done[t]


def _hardened(v):
    """h set to 0 or 1: ``rectified(v) >= 0.5``."""
    return (_rectified(v).detach() >= 0.5).double()


def _rectified(v):
    return torch.clamp(torch.sigmoid(v) * (ZETA - GAMMA) + GAMMA, 0, 1)


def _compared(program: QdqProgram, block: Block, env, floats):
    """(float target name, the block's output as the float model would see it, the target)
    for each of the block's float outputs (an integer one is a shape the graph reads on)."""
    for t in block.outputs:
        if env[t].is_floating_point():
            yield program.target[t], program.activated(t, env[t]), floats[program.target[t]]


def _block_db(envs, floats, block, program) -> float:
    signal = noise = 0.0
    for env, wanted in zip(envs, floats):
        for _, got, want in _compared(program, block, env, wanted):
            got, want = got.double(), want.double()
            signal += float((want * want).sum())
            noise += float(((got - want) ** 2).sum())
    return 10 * math.log10(max(signal, 1e-30) / max(noise, 1e-30))
