"""The measured choice in the pipeline: a record replayed, or the families timed, then the run written.

:func:`tuned_run` is what ``optimize`` does where the target's runtime is here (:mod:`opfuse.tune`):
the configuration of the fusion families is replayed from a record (``--tuning``, or the cache of
:mod:`opfuse.tune.record`) or timed (:func:`opfuse.tune.tune`) on the whole model or the prefix
through its first repeated block (:mod:`opfuse.tune.block`); then the pipeline's rewrites run once
more with it, on the whole model, with verification's reference (``configured``, the pipeline's own
step, passed in: this module does not import the pipeline).
"""

from __future__ import annotations

__all__ = ["tuned_run"]

import dataclasses
from collections.abc import Callable, Mapping

import onnx_ir as ir

from opfuse.core.ops import first_line
from opfuse.errors import BadInputError
from opfuse.load import ModelSource, load_model
from opfuse.passes.pattern_gate import passes_that_could_run, patterns_that_could_match
from opfuse.prepare.constant_inputs import resolve_constant_inputs
from opfuse.report import Refusal
from opfuse.runtime import give_back_memory
from opfuse.tune import replayed, tune, tuning_feeds, untimed
from opfuse.tune.block import cut_lookups, find_block, is_small, prefix_model
from opfuse.tune.families import policy_configuration
from opfuse.tune.record import cache_path, load_record, machine, save_record, signature


def _policy_for(loaded: ir.Model, options, plan):
    """The target's untimed policy for ``loaded`` as a configuration (its exception where the graph is one)."""
    exception = next((dict(e.untimed) for e in plan.chosen.exceptions
                      if e.untimed and (e.untimed_where or e.sites)(loaded)), None)
    return policy_configuration(plan.chosen, options.opset is not None, exception)


def tuned_run(model: ModelSource, options, plan, configured: Callable):
    """The configuration of the fusion families to write (:mod:`opfuse.tune`): replayed from a
    record (``--tuning``, or the cache), or timed on the whole model or its first block (a large
    model without one is not timed); then the rewrites run once more with it, on the whole model,
    with verification's reference. Tuning never fails a run that would succeed untimed: where it
    raises, the target's policy applies and the log says why."""
    original, display = load_model(model)  # (not mutated by the timing: the final run takes it)
    policy = _policy_for(original, options, plan)
    reports: dict = {}
    small = is_small(original)
    block = None if small else find_block(original)
    if options.tuning is None and not small and block is None:
        chosen, tuning = policy, untimed(options.target, "a large model with no repeated block to time on its own",
                                         measured_policy=bool(plan.chosen.exceptions))
    else:
        sig = signature(original, target=options.target, level=options.runtime_level, opset=options.opset,
                        dims=dict(options.dims or {}), passes=plan.names, approximate=options.approximate,
                        bound=sorted((options.constant_inputs or {}).keys()))
        cached = cache_path(sig, options.tune_threads)
        if options.tuning is not None:
            record = load_record(options.tuning)
            if record.get("signature") not in (sig, None, ""):
                raise BadInputError(f"{options.tuning}: the tuning record is of another graph or options (signature "
                                    f"{record.get('signature')}, this run's {sig}); --retune times this one")
            chosen, tuning = replayed(record, f"replayed from {options.tuning}")
        elif not options.retune and cached.exists():
            try:
                chosen, tuning = replayed(load_record(cached), f"replayed from the cache ({cached})")
            except (BadInputError, ValueError, KeyError, TypeError):  # a stale cache entry: time again
                chosen, tuning = _timed(model, original, block, policy, options, plan, reports, configured)
        else:
            chosen, tuning = _timed(model, original, block, policy, options, plan, reports, configured)
        if tuning.timed:
            tuning.signature, tuning.machine, tuning.target = sig, machine(options.tune_threads), options.target
            tuning.configuration = None if chosen is None else chosen.to_dict()
            save_record(tuning.record(), cached)
        elif tuning.declined and chosen is not None:  # replayed: the declined fusions' sites, as timed
            _explain(model, original, block, options, plan, tuning, reports, configured)
    give_back_memory()  # (what the timed sessions and variants freed)
    run = configured(model, options, plan, chosen, verify=options.verify, loaded=(original, display))
    run.report.tuning = tuning
    if chosen is not None:
        run.report.refusals.extend(_declined(reports, tuning))
    tuning.describe_written(run.work)
    return run


def _scope(model: ModelSource, original: ir.Model, block, options):
    """What the configurations are timed on: the whole model (``block`` None), else the prefix through
    ``block`` (:mod:`opfuse.tune.block`); as (what ``configured`` takes, the loaded model of it, the
    options with the constant inputs it has, a description)."""
    scope, timed_model = "the whole model", model
    if block is not None:
        prefix = prefix_model(original.clone(), block)
        scope = f"on {block.describe()}: the prefix through it, {sum(1 for _ in prefix.graph)} nodes"
        timed_model = prefix
    timed_original = timed_model if isinstance(timed_model, ir.Model) else original
    sub_options = dataclasses.replace(options, constant_inputs={
        k: v for k, v in (options.constant_inputs or {}).items() if k in {i.name for i in timed_original.graph.inputs}})
    return timed_model, timed_original, sub_options, scope


def _explain(model: ModelSource, original: ir.Model, block, options, plan, tuning, reports: dict,
             configured: Callable) -> None:
    """For a replayed record: the rewrites of each declined decision's two configurations, on what the
    timed run ran them on (the whole model or its first block), untimed, into ``reports``, so that
    :func:`_declined` names each site as after timing. Best effort: where they raise, the decision
    stands without its sites."""
    try:
        timed_model, timed_original, sub_options, _ = _scope(model, original, block, options)
        source = timed_original if timed_model is not model else model
        for config in {c for with_it, without, _ in tuning.declined for c in (with_it, without)}:
            reports[config] = configured(source, sub_options, plan, config, verify=False).report
    except Exception:  # noqa: BLE001 - explaining never fails a run
        reports.clear()


def _timed(model: ModelSource, original: ir.Model, block, policy, options, plan,
           reports: dict, configured: Callable):
    """Time the families (:func:`opfuse.tune.tune`) on the whole model (``block`` None), else on the
    prefix through ``block`` (:mod:`opfuse.tune.block`). Fills ``reports`` (configuration -> the
    report of its rewrites) for the refusals."""
    bound = resolve_constant_inputs(original, options.constant_inputs)
    lookups = []
    timed_model, timed_original, sub_options, scope = _scope(model, original, block, options)
    feeds = None
    try:
        if timed_model is not model:  # the prefix: its feeds drawn with its lookups, then the lookups cut
            fed, shapes = tuning_feeds(timed_original, options.dims, level=options.runtime_level, seed=options.seed,
                                       bound={k: v for k, v in bound.items() if k in sub_options.constant_inputs})
            lookups = cut_lookups(timed_original)
            fed.update({lookup.name: lookup.feed(fed) for lookup in lookups})
            feeds = (fed, shapes + (f"; {len(lookups)} lookup table(s) fed as inputs" if lookups else ""))
        runs: dict = {}

        def build(config):  # a variant to time: no reference kept for verification
            if config not in runs:
                run = configured(timed_original if timed_model is not model else model, sub_options, plan, config,
                                  verify=False)
                reports[config] = run.report
                runs[config] = run.work
            return runs[config]

        return tune(timed_original, build, target=options.target, policy=policy, dims=options.dims,
                    bound={k: v for k, v in bound.items() if k in sub_options.constant_inputs},
                    level=options.runtime_level, threads=options.tune_threads, rounds=options.tune_rounds,
                    seed=options.seed, exact=not plan.inexact, feeds=feeds, scope=scope,
                    possible=lambda patterns, passes: bool(passes_that_could_run(
                        timed_original, set(passes) & set(plan.names))) or bool(
                        patterns_that_could_match(timed_original, plan.chosen, patterns,
                                                  approximate=options.approximate)))
    except BadInputError as e:  # the input runs at no size tried: nothing to time
        return policy, untimed(options.target, str(e), measured_policy=bool(plan.chosen.exceptions))
    except Exception as e:  # noqa: BLE001 - tuning never fails a run the policy would finish
        return policy, untimed(options.target, f"tuning failed: {first_line(e, limit=200)}",
                               measured_policy=bool(plan.chosen.exceptions))


def _declined(reports: Mapping, tuning) -> list[Refusal]:
    """One refusal per site of each fusion the measured choice declined: the rewrites the
    configuration with it made and the one without it did not, with the measured reason."""
    out = []
    for with_it, without, reason in tuning.declined:
        if with_it not in reports or without not in reports:
            continue
        kept = {(r.pattern, r.node) for r in reports[without].records}
        out += [Refusal(r.pattern, r.node, reason, graph=r.graph, also=r.removed)
                for r in reports[with_it].records if (r.pattern, r.node) not in kept]
    return out
